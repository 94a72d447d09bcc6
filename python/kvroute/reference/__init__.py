"""The pure-Python reference twin of kvroute._native.

Same names, signatures, results and errors as the compiled core. It is the oracle the
tests compare the core against, the baseline the benchmarks measure it against, and what
runs when KVROUTE_IMPLEMENTATION=python.
"""

from __future__ import annotations

from .hashing import block_hashes, xxh3_64
from .events import EventApplier
from .gil import _release_gil_always  # noqa: F401 - the testing hook's twin, private
from .index import PrefixIndex
from .router import Decision, Router

__all__ = ["xxh3_64", "block_hashes", "PrefixIndex", "Router", "Decision", "EventApplier"]
