"""KV events on vLLM's wire: msgspec structs mirroring vLLM's, encoded to msgpack.

vLLM (vllm/distributed/kv_events.py) declares its events as msgspec structs with
`tag=True`; the batch is `array_like` ([ts, events, data_parallel_rank]). Until PR #42892
the events were `array_like` too (positional arrays, tag first, a fixed length per
release: 12 elements for BlockStored in v0.23); since v0.25 they are maps with a "type"
key and `omit_defaults`, so the optional fields are left out when None
(../shared/docs/kv-events.md A2 and D). `encoding="maps"` produces the current form,
`"arrays"` the positional one. Block hashes go out as msgpack uints, as vLLM sends them
with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (its default).

The engine model's events (kvroute.sim) are read by attribute, so any object with
block_hashes / parent_block_hash / token_ids / block_size (and optionally lora_name,
extra_keys, medium) encodes; the class name decides the event type.
"""

from __future__ import annotations

import time
from typing import Any, Sequence, Union

import msgspec

ENCODINGS = ("maps", "arrays")


class _StoredMap(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Any], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Any], None]
    group_idx: Union[int, None]
    kv_cache_spec_kind: Union[str, None]
    kv_cache_spec_sliding_window: Union[int, None]


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[int]
    medium: Union[str, None]
    group_idx: Union[int, None]


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None]


_ENCODER = msgspec.msgpack.Encoder()


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


def _extra_keys(ev: Any, n: int) -> list[Any]:
    """Per block, vLLM's extra keys (LoRA name, mm items, cache_salt on block 0) or None."""
    given = getattr(ev, "extra_keys", None)
    if given is not None:
        return list(given)
    lora = getattr(ev, "lora_name", None)
    return [[lora] if lora else None for _ in range(n)]


def _stored(ev: Any, arrays: bool) -> Any:
    hashes = _ints(ev.block_hashes)
    parent = ev.parent_block_hash
    args = (hashes, None if parent is None else int(parent), _ints(ev.token_ids), int(ev.block_size),
            None, getattr(ev, "medium", None) or "GPU", getattr(ev, "lora_name", None))
    extra = _extra_keys(ev, len(hashes))
    if arrays:
        return _StoredArray(*args, extra, 0, "full_attention", None)
    return _StoredMap(*args, extra, 0, "full_attention")


def to_wire(ev: Any, encoding: str = "maps") -> Any:
    """One engine-model event as the msgspec struct vLLM would publish."""
    arrays = encoding == "arrays"
    kind = type(ev).__name__
    if kind == "BlockStored":
        return _stored(ev, arrays)
    if kind == "BlockRemoved":
        hashes = _ints(ev.block_hashes)
        medium = getattr(ev, "medium", None) or "GPU"
        return _RemovedArray(hashes, medium, 0) if arrays else _RemovedMap(hashes, medium, 0)
    if kind == "AllBlocksCleared":
        return _ClearedArray() if arrays else _ClearedMap()
    raise TypeError(f"not a KV event: {kind}")


def encode_batch(events: Sequence[Any], encoding: str = "maps", *, ts: float | None = None,
                 rank: int | None = 0) -> bytes:
    """One msgpack KVEventBatch [ts, events, data_parallel_rank] for these events."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    wire = [to_wire(ev, encoding) for ev in events]
    return _ENCODER.encode(_Batch(time.time() if ts is None else float(ts), wire, rank))


__all__ = ["ENCODINGS", "encode_batch", "to_wire"]
