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
