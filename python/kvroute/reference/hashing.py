"""Chained block hashing, reference twin of cpp/src/hash.cpp.

The contract (README, "Block hashing"): tokens are serialized as uint32 little-endian and
cut into blocks of `block_size` tokens; a trailing partial block is not hashed.
h_root = XXH3-64(salt, seed=0); h_i = XXH3-64(block i, seed=h_(i-1)), h_(-1) = h_root.

Per-request keys (contract C1), where vLLM puts them (vllm/v1/core/kv_cache_utils.py,
generate_block_hash_extra_keys / hash_block_tokens) but in a reproducible byte form:
- lora and cache_salt enter the root: h_root' = XXH3-64(['L' u32le(len) lora]['C' u32le(len)
  cache_salt], seed=h_root), each part only when given and non-empty (vLLM keys every block
  with the LoRA name and block 0 with the salt; keying the root makes the chain differ from
  block 0 on, the same partition of prompts).
- A multimodal item (identifier, offset, length) is appended to the payload of the block its
  first token lies in: block bytes + 'M' u32le(len id) id u64le(offset) per item, items in
  (offset, input order) order. vLLM keys every block the item overlaps with (identifier,
  offset - block start); keying the first one suffices because every later block is chained
  from it, and it needs only what engines publish per block (no length).
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


MmItem = tuple[str, int, int]


def block_hashes(
    tokens: Any,
    block_size: int = 16,
    *,
    salt: str | bytes | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
    mm: Any = None,
) -> np.ndarray:
    """Chained XXH3-64 hashes of the full blocks of `tokens`, as a uint64 array.

    lora, cache_salt and mm (sequence of (identifier, offset, length)) are the request's
    cache keys (README "Block hashing")."""
    size = check_block_size(block_size)
    data = tokens_as_uint32(tokens)
    r0 = xxhash.xxh3_64_intdigest(salt_bytes(salt), 0)
    root, items = request_keys(r0, lora, cache_salt, mm)
    if items:
        return np.array(chain_keyed(data.tobytes(), size, root, 0, items), dtype=np.uint64)
    seed = root
    count = len(data) // size
    out = np.empty(count, dtype=np.uint64)
    raw = data.tobytes()
    step = 4 * size
    for i in range(count):
        seed = xxhash.xxh3_64_intdigest(raw[i * step : (i + 1) * step], seed)
        out[i] = seed
    return out


def request_keys(r0: int, lora: Any, cache_salt: Any, mm: Any) -> tuple[int, list[tuple[bytes, int]]]:
    """The chain root for these keys and the mm items as (identifier bytes, offset), sorted."""
    lora_b = _utf8_or_none(lora, "lora")
    salt_b = _utf8_or_none(cache_salt, "cache_salt")
    items = mm_items(mm)
    return keyed_root(r0, lora_b, salt_b), items


def keyed_root(r0: int, lora: bytes, cache_salt: bytes) -> int:
    """XXH3-64 of the 'L'/'C' key parts seeded with r0; r0 when both are empty."""
    if not lora and not cache_salt:
        return r0
    k = b""
    if lora:
        k += b"L" + len(lora).to_bytes(4, "little") + lora
    if cache_salt:
        k += b"C" + len(cache_salt).to_bytes(4, "little") + cache_salt
    return xxhash.xxh3_64_intdigest(k, r0)


def mm_key(identifier: bytes, offset: int) -> bytes:
    """The bytes one multimodal item appends to its block's payload."""
    return b"M" + len(identifier).to_bytes(4, "little") + identifier + offset.to_bytes(8, "little")


def chain_keyed(raw: bytes, size: int, seed: int, start: int, items: list[tuple[bytes, int]]) -> list[int]:
    """Chained hashes of the blocks of `raw` (uint32 LE tokens starting at prompt position
    `start`), each block's payload followed by the keys of the items that start in it."""
    out = []
    step = 4 * size
    for b in range(len(raw) // step):
        begin = start + b * size
        payload = raw[b * step : (b + 1) * step]
        for ident, off in items:
            if begin <= off < begin + size:
                payload += mm_key(ident, off)
        seed = xxhash.xxh3_64_intdigest(payload, seed)
        out.append(seed)
    return out


def mm_items(mm: Any) -> list[tuple[bytes, int]]:
    """mm validated, as (identifier UTF-8, offset) sorted by offset (input order on ties)."""
    if mm is None:
        return []
    if not isinstance(mm, (list, tuple)):
        raise TypeError(f"mm must be a list or tuple of (identifier, offset, length), got {type(mm).__name__}")
    out = []
    for i, item in enumerate(tuple(mm)):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise TypeError(f"mm[{i}] must be an (identifier, offset, length) tuple, got {type(item).__name__}")
        ident, offset, length = tuple(item)
        if not isinstance(ident, str):
            raise TypeError(f"mm[{i}] identifier must be a str, got {type(ident).__name__}")
        raw = utf8_bytes(ident, f"mm[{i}] identifier")
        out.append((raw, _mm_int(offset, i, "offset", 0)))
        _mm_int(length, i, "length", 1)
    out.sort(key=lambda it: it[1])  # stable: input order on equal offsets
    return out


def _mm_int(value: Any, i: int, what: str, lo: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
        raise TypeError(f"mm[{i}] {what} must be an int, got {type(value).__name__}")
    v = operator.index(value)
    if not lo <= v < (1 << 63):
        raise ValueError(f"mm[{i}] {what} must be in [{lo}, 2**63), got {v}")
    return v


def _utf8_or_none(value: Any, name: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    return utf8_bytes(value, name)


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
