"""kvroute: cache-aware request routing for LLM serving fleets.

The public names below come from the compiled core (kvroute._native) or, with
KVROUTE_IMPLEMENTATION=python or when the core is missing, from the pure-Python
reference twin (kvroute.reference). Both have the same signatures, results and errors.
`kvroute.implementation` says which one is in use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._backend import backend as _backend
from ._backend import implementation
from .config import RouterConfig  # shared by both implementations

__version__ = "0.1.0"

if TYPE_CHECKING:
    # Type checkers see the typed stub of the native core (python/kvroute/_native.pyi), the
    # API both implementations share; at run time the names come from the chosen backend.
    from ._native import Decision, EventApplier, PrefixIndex, Router, block_hashes, xxh3_64
else:
    xxh3_64 = _backend.xxh3_64
    block_hashes = _backend.block_hashes
    PrefixIndex = _backend.PrefixIndex
    Router = _backend.Router
    Decision = _backend.Decision
    EventApplier = _backend.EventApplier

__all__ = [
    "__version__",
    "implementation",
    "xxh3_64",
    "block_hashes",
    "PrefixIndex",
    "Router",
    "Decision",
    "EventApplier",
    "RouterConfig",
]
