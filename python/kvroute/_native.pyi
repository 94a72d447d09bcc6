"""Type stub of kvroute._native, the C++ core; kept in sync by tests/test_stub.py (stubtest).

Each concept adds its own section; the runtime twin of every name is in kvroute.reference.
"""

from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str

# --- hashing (cpp/bindings/register_hashing.cpp) ---

def xxh3_64(data: Any, seed: Any = 0) -> int:
    """XXH3-64 of a bytes-like object with a 64-bit seed."""

def block_hashes(tokens: Any, block_size: Any = 16, *, salt: Any = None) -> npt.NDArray[np.uint64]:
    """Chained XXH3-64 hashes of the full blocks of `tokens`, as a uint64 array."""

# --- events (cpp/bindings/register_events.cpp) ---

class EventApplier:
    """Applies one fleet's engine KV events (vLLM, SGLang) to a PrefixIndex."""

    def __init__(self, index: Any, block_size: Any = 16, *, salt: Any = None, tier_index: Any = None) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def salt(self) -> bytes: ...
    @property
    def index(self) -> Any: ...
    @property
    def tier_index(self) -> Any: ...
    def apply(self, replica: Any, payload: Any) -> bool: ...
    def apply_stored(
        self,
        replica: Any,
        block_hashes: Any,
        parent_block_hash: Any,
        token_ids: Any,
        *,
        block_size: Any = None,
        medium: Any = None,
    ) -> int: ...
    def apply_removed(self, replica: Any, block_hashes: Any, *, medium: Any = None) -> int: ...
    def clear_replica(self, replica: Any) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def replica_stats(self, replica: Any) -> dict[str, Any]: ...
