"""Chained block hashing, reference twin of cpp/src/hash.cpp.

The contract (README, "Block hashing"): tokens are serialized as uint32 little-endian and
cut into blocks of `block_size` tokens; a trailing partial block is not hashed.
h_root = XXH3-64(salt, seed=0); h_i = XXH3-64(block i, seed=h_(i-1)), h_(-1) = h_root.
"""

from __future__ import annotations

import array
import operator
from typing import Any

import numpy as np
import xxhash

from .args import int_buffer, refuse_masked, utf8_bytes

MAX_BLOCK_SIZE = 65536
_TOKEN_LIMIT = 1 << 32
_SEED_LIMIT = 1 << 64


def xxh3_64(data: Any, seed: int = 0) -> int:
    """XXH3-64 of a bytes-like object with a 64-bit seed."""
    if isinstance(data, str) or not _is_buffer(data):
        raise TypeError(f"data must be a bytes-like object, got {type(data).__name__}")
    value = _check_seed(seed)
    if isinstance(data, bytes):
        return xxhash.xxh3_64_intdigest(data, value)
    view = memoryview(data)
    # A strided buffer hashes its C-order bytes, the bytes memoryview.tobytes() gives.
    raw = view.cast("B") if view.c_contiguous else view.tobytes()
    return xxhash.xxh3_64_intdigest(raw, value)


def block_hashes(tokens: Any, block_size: int = 16, *, salt: str | bytes | None = None) -> np.ndarray:
    """Chained XXH3-64 hashes of the full blocks of `tokens`, as a uint64 array."""
    size = check_block_size(block_size)
    data = tokens_as_uint32(tokens)
    seed = xxhash.xxh3_64_intdigest(salt_bytes(salt), 0)
    count = len(data) // size
    out = np.empty(count, dtype=np.uint64)
    raw = data.tobytes()
    step = 4 * size
    for i in range(count):
        seed = xxhash.xxh3_64_intdigest(raw[i * step : (i + 1) * step], seed)
        out[i] = seed
    return out


def check_block_size(block_size: Any) -> int:
    """block_size as an int in [1, 65536], or TypeError/ValueError."""
    if isinstance(block_size, (bool, np.bool_)) or not _is_integer(block_size):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    value = operator.index(block_size)
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {value}")
    return value


def salt_bytes(salt: Any) -> bytes:
    """The bytes the root hash is taken over: b'' for None, UTF-8 for str."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return utf8_bytes(salt, "salt")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")


def tokens_as_uint32(tokens: Any) -> np.ndarray:
    """Validate tokens and return them as a little-endian uint32 array.

    Accepts a 1-D numpy array of an integer dtype, a list or tuple of ints, or an
    array.array of an integer typecode.
    """
    if isinstance(tokens, np.ndarray):
        return _array_as_uint32(tokens)
    if isinstance(tokens, array.array):
        if tokens.typecode not in "bBhHiIlLqQ":
            raise TypeError(
                f"tokens must have an integer dtype, got array.array of typecode {tokens.typecode!r}"
            )
        return _array_as_uint32(np.frombuffer(tokens, dtype=np.dtype(tokens.typecode)))
    if isinstance(tokens, (list, tuple)):
        tokens = tuple(tokens)  # a snapshot: an item's __index__ may resize a list
        out = np.empty(len(tokens), dtype="<u4")
        for i, token in enumerate(tokens):
            if isinstance(token, (bool, np.bool_)) or not _is_integer(token):
                raise TypeError(f"tokens[{i}] must be an int, got {type(token).__name__}")
            value = operator.index(token)
            if not 0 <= value < _TOKEN_LIMIT:
                raise ValueError(f"token {value} at index {i} is out of range [0, 2**32)")
            out[i] = value
        return out
    buffered = int_buffer(tokens)  # memoryview or another exporter, read in place
    if buffered is not None:
        return _array_as_uint32(buffered)
    raise TypeError(
        "tokens must be a 1-D integer numpy array, a list or tuple of ints, or an "
        f"array.array, got {type(tokens).__name__}"
    )


def _array_as_uint32(arr: np.ndarray) -> np.ndarray:
    refuse_masked(arr, "tokens")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got a {arr.ndim}-D array")
    if arr.size:
        bad = (arr < 0) | (arr >= _TOKEN_LIMIT) if arr.dtype.kind == "i" else arr >= _TOKEN_LIMIT
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"token {int(arr[i])} at index {i} is out of range [0, 2**32)")
    return arr.astype("<u4", copy=False)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, (bool, np.bool_)) or not _is_integer(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    value = operator.index(seed)
    if not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {value}")
    return value


def _is_integer(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_buffer(value: Any) -> bool:
    try:
        memoryview(value)
    except TypeError:
        return False
    return True
