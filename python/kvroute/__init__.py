"""kvroute: cache-aware request routing for LLM serving fleets.

The public names below come from the compiled core (kvroute._native) or, with
KVROUTE_IMPLEMENTATION=python or when the core is missing, from the pure-Python
reference twin (kvroute.reference). Both have the same signatures, results and errors.
`kvroute.implementation` says which one is in use.
"""

from __future__ import annotations

from ._backend import backend as _backend
from ._backend import implementation

__version__ = "0.1.0"

xxh3_64 = _backend.xxh3_64
block_hashes = _backend.block_hashes
PrefixIndex = _backend.PrefixIndex
Router = _backend.Router
Decision = _backend.Decision
EventApplier = _backend.EventApplier
from .config import RouterConfig  # noqa: E402 - shared by both implementations

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
