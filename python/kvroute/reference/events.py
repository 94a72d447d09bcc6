"""KV-cache events of vLLM and SGLang: decoding and applying, reference twin of cpp/src/events.cpp.

Wire formats: docs kv-events.md (vLLM positional arrays and tagged maps, SGLang positional).

Decoding (`decode`) turns one msgpack batch into plain frozen dataclasses:

- The batch is an array [ts, events, dp_rank?, ...] (2 or more elements; extra trailing
  elements are ignored) or a map {"ts", "events", "data_parallel_rank"}.
- An event is an array whose first element is its type name, or a map whose "type" key
  holds it. BlockStored, BlockRemoved and AllBlocksCleared are understood; other types are
  skipped and counted in `EventBatch.ignored`. Unknown map keys and trailing array elements
  are ignored; missing ones are None.
- Engine block hashes (ints, signed or unsigned, or bin) are normalized to uint64: a
  negative int is bit-cast, a bin gives its last 8 bytes big-endian (fewer bytes: all of
  them), as llm-d does.
- Anything else (not msgpack, trailing bytes, wrong types or shapes, token_ids whose length
  is not len(block_hashes) * block_size) raises MalformedBatch (a ValueError) naming the
  first problem. The native reader raises the same messages.

- More than MAX_DEPTH (32) nested containers is "not valid msgpack" in both
  implementations (msgspec alone would accept ~1000 levels, the native reader had 512).
- BlockStored also yields lora_name, cache_salt (SGLang: a map key, or a trailing
  {"cache_salt": ...} map where vLLM has lora_name), extra_keys per block and group_idx;
  BlockRemoved yields group_idx.

Applying (`EventApplier`) mirrors each engine's cached blocks into a PrefixIndex (README,
"Precise mode"):

- Event-level application. A payload that does not decode is skipped whole (counted in
  malformed, message in last_error). Otherwise every event applies in order, except that an
  event that cannot be resolved is skipped alone and counted by kind in
  replica_stats()["skipped"]: a BlockStored whose parent is unknown (unknown_parent), whose
  extra keys cannot be reproduced (unsupported_keys: prompt-embedding digests, identifiers
  without offsets, a second string on block 0) or whose group_idx is outside [0, 64)
  (unsupported_group); a removed hash the replica does not hold in that medium and group
  (unknown_removal, per hash; the other hashes of the event apply).
- Per replica and KV-cache group, a map (engine hash -> entry). Each entry keeps its token
  positions, the kvroute chain state at its end (the hash at the last router-block boundary
  and the tokens after it) and the router blocks it completes. Engine blocks of any size:
  a multiple of block_size completes E / block_size router blocks; a smaller or misaligned
  one (SGLang pages of 1 token) carries its tokens to the next page, and a router block is
  held while every page covering its tokens is held (a page's removal uncounts the router
  block of each later page that spans it). Per-request keys enter the chain as in
  block_hashes: lora_name and cache_salt (SGLang's, or the string on vLLM's block 0
  extra_keys) in the root of a chain without parent, (identifier, offset) pairs in the
  router block where the item starts.
- Duplicates: an entry holds a *set* of media. A repeated store of one (engine hash,
  medium, group), such as vLLM 0.33's reuse reports, changes nothing but recency
  (duplicate_stores); one removal drops it. Two physical copies of one hash, one evicted,
  are therefore under-claimed until the engine stores the hash again: never an over-claim.
- The index holds, for a replica, the router blocks held (in the tier) in every group the
  replica has announced; hybrid models are never claimed beyond what all groups hold.
- Engine block size: the replica's k = lcm over its groups of E / block_size (1 for smaller
  or misaligned E) is set with index.set_engine_block, so matches round down to whole
  engine blocks.
- medium None or "GPU" goes to `index`; any other medium ("CPU", "CPU_PINNED", "DISK",
  "STORAGE", ...) goes to `tier_index` when one is given, else it is only counted.
  AllBlocksCleared drops all of the replica's blocks, in every medium and group.
- Memory: with an index capacity C, each group's map keeps at most C * ceil(block_size / E)
  entries; the oldest-stored go first (map_evictions) and their blocks leave the index, so
  the index never holds a block the map forgot. Without capacity, the maps hold what the
  engine holds.
- A bad argument, or a replica removed from index or tier_index, raises before anything
  changes; if an index drops the replica midway (remove_replica racing apply), the
  replica's state is forgotten and the IndexError propagates.
- If the index refuses a chain (its parent left the index, or a conflict), the blocks are
  kept in the map but not indexed, counted in index_conflicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from .args import check_text
from .hashing import chain_keyed, check_block_size, keyed_root, salt_bytes, tokens_as_uint32
from .index import MAX_ENGINE_BLOCK, PrefixIndex, as_hash, as_hashes

_LOG = logging.getLogger("kvroute.events")
_U64 = 1 << 64
_MASK64 = _U64 - 1
_TOKEN_LIMIT = 1 << 32
_GPU = "GPU"


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch; the message names the first problem."""


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Blocks the engine now holds: hashes normalized to uint64, tokens flattened.

    extra_keys: per engine block, None or a tuple of keys, each a str, a (str, int) pair (a
    multimodal identifier and its offset relative to the block start) or OTHER_KEY (anything
    else: prompt-embedding digests, ints); group_idx: the KV-cache group (None = 0);
    cache_salt: SGLang's (a map key, or a trailing {"cache_salt": ...} map)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int | None
    medium: str | None = None
    lora_id: Any = None
    lora_name: Any = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks the engine stopped holding (one BlockStored each), hashes normalized to uint64."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True)
class EventBatch:
    """One published batch: engine timestamp, the understood events, DP rank, skipped count."""

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    ignored: int = 0


# -- decoding -----------------------------------------------------------------------------------


def type_name(value: Any) -> str:
    """The msgpack type of a decoded value, as error messages name it."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bin"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "map"
    return "ext"


def normalize_hash(value: Any) -> int | None:
    """An engine block hash as uint64, or None if it is neither an int nor bin."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return None


def decode(payload: Any) -> EventBatch:
    """Decode one msgpack KV event batch (vLLM or SGLang) or raise MalformedBatch."""
    try:
        data = bytes(memoryview(payload))
    except TypeError:
        raise TypeError(f"payload must be a bytes-like object, got {type(payload).__name__}") from None
    try:
        obj = _msgpack_decode()(data)
    except Exception:  # noqa: BLE001 - any decoder failure is the same malformed payload
        raise MalformedBatch("payload is not valid msgpack") from None
    if not _depth_ok(obj):
        raise MalformedBatch("payload is not valid msgpack")
    return _batch(obj)


MAX_DEPTH = 32
"""Most containers a payload may nest: a container inside MAX_DEPTH others makes the payload
"not valid msgpack" in both implementations (msgspec alone would accept ~1000 levels; an
event batch needs 6)."""


def _depth_ok(obj: Any) -> bool:
    stack = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = [x for kv in value.items() for x in kv]
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth >= MAX_DEPTH:
            return False
        for child in children:
            if isinstance(child, (list, tuple, dict)):
                stack.append((child, depth + 1))
    return True


_DECODE: Any = None


def _msgpack_decode() -> Any:
    """msgspec's generic msgpack decoder, imported on first use: msgspec is in the `events`
    extra, and kvroute (including this reference twin) must import without it."""
    global _DECODE
    if _DECODE is None:
        import msgspec

        _DECODE = msgspec.msgpack.Decoder().decode
    return _DECODE


def _batch(obj: Any) -> EventBatch:
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedBatch(f"batch array has {len(obj)} elements, expected at least 2")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        raise MalformedBatch(f"batch must be an array or map, got {type_name(obj)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise MalformedBatch(f"batch ts must be a number, got {type_name(ts)}")
    if not isinstance(events, list):
        raise MalformedBatch(f"batch events must be an array, got {type_name(events)}")
    out: list[Event] = []
    ignored = 0
    for i, ev in enumerate(events):
        got = _event(i, ev)
        if got is None:
            ignored += 1
        else:
            out.append(got)
    if isinstance(rank, bool) or not isinstance(rank, int):
        rank = None
    return EventBatch(float(ts), tuple(out), rank, ignored)


# Field names in wire order: position k + 1 of a positional event, or the map key. One table
# per event type, read by _fields; cpp/src/events_decode.cpp has the same table.
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "cache_salt",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")

class _OtherKey:
    """An extra key that is neither a str nor a (str, int) pair: prompt-embedding digests,
    ints, anything newer; an event carrying one cannot be hashed as routed prompts are."""

    def __repr__(self) -> str:
        return "OTHER_KEY"


OTHER_KEY: Any = _OtherKey()


def _fields(ev: Any, names: tuple[str, ...]) -> list[Any]:
    if isinstance(ev, list):
        return [ev[k + 1] if k + 1 < len(ev) else None for k in range(len(names))]
    return [ev.get(name) for name in names]


def _event(i: int, ev: Any) -> Event | None:
    if isinstance(ev, list):
        if not ev:
            raise MalformedBatch(f"event {i} is an empty array")
        tag = ev[0]
    elif isinstance(ev, dict):
        tag = ev.get("type")
    else:
        raise MalformedBatch(f"event {i} must be an array or map, got {type_name(ev)}")
    if not isinstance(tag, str):
        raise MalformedBatch(f"event {i} type must be a str, got {type_name(tag)}")
    if tag == "BlockStored":
        hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group, _, _, salt = _fields(
            ev, _STORED_FIELDS)
        where = f"event {i} (BlockStored)"
        hs = _hashes(where, hashes)
        if parent is not None:
            p = normalize_hash(parent)
            if p is None:
                raise MalformedBatch(f"{where} parent_block_hash must be nil, an int or bin, got {type_name(parent)}")
            parent = p
        if not isinstance(tokens, list):
            raise MalformedBatch(f"{where} token_ids must be an array, got {type_name(tokens)}")
        for j, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int):
                raise MalformedBatch(f"{where} token_ids[{j}] must be an int, got {type_name(t)}")
            if not 0 <= t < _TOKEN_LIMIT:
                raise MalformedBatch(f"{where} token_ids[{j}] = {t} is out of range [0, 2**32)")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int):
                raise MalformedBatch(f"{where} block_size must be nil or an int, got {type_name(size)}")
            if size <= 0:
                raise MalformedBatch(f"{where} block_size must be positive, got {size}")
            if len(tokens) != len(hs) * size:
                raise MalformedBatch(
                    f"{where} has {len(tokens)} token_ids for {len(hs)} blocks of {size} tokens"
                )
        elif not hs or not tokens or len(tokens) % len(hs):
            raise MalformedBatch(f"{where} has {len(tokens)} token_ids for {len(hs)} blocks")
        _medium(where, medium)
        lora_id = lora_id if isinstance(lora_id, int) and not isinstance(lora_id, bool) else None
        # SGLang 0.5.18 puts a {"cache_salt": ...} map where vLLM has lora_name.
        if isinstance(lora_name, dict):
            if salt is None:
                salt = lora_name.get("cache_salt")
            lora_name = None
        lora_name = lora_name if isinstance(lora_name, str) else None
        salt = salt if isinstance(salt, str) else None
        keys = _extra_keys(where, extra)
        return BlockStored(tuple(hs), parent, tuple(tokens), size, medium, lora_id, lora_name, keys,
                           _group(where, group), salt)
    if tag == "BlockRemoved":
        hashes, medium, group = _fields(ev, _REMOVED_FIELDS)
        where = f"event {i} (BlockRemoved)"
        hs = _hashes(where, hashes)
        _medium(where, medium)
        return BlockRemoved(tuple(hs), medium, _group(where, group))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _hashes(where: str, hashes: Any) -> list[int]:
    if not isinstance(hashes, list):
        raise MalformedBatch(f"{where} block_hashes must be an array, got {type_name(hashes)}")
    out = []
    for j, h in enumerate(hashes):
        v = normalize_hash(h)
        if v is None:
            raise MalformedBatch(f"{where} block_hashes[{j}] must be an int or bin, got {type_name(h)}")
        out.append(v)
    return out


def _group(where: str, group: Any) -> int | None:
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, int):
        raise MalformedBatch(f"{where} group_idx must be nil or an int, got {type_name(group)}")
    return group


def _extra_keys(where: str, extra: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    """extra_keys as per-block tuples of str, (str, int) or OTHER_KEY."""
    if extra is None:
        return None
    if not isinstance(extra, list):
        raise MalformedBatch(f"{where} extra_keys must be nil or an array, got {type_name(extra)}")
    out: list[tuple[Any, ...] | None] = []
    for j, keys in enumerate(extra):
        if keys is None:
            out.append(None)
            continue
        if not isinstance(keys, list):
            raise MalformedBatch(f"{where} extra_keys[{j}] must be nil or an array, got {type_name(keys)}")
        out.append(tuple(_key(k) for k in keys))
    return tuple(out)


def _key(key: Any) -> Any:
    if isinstance(key, str):
        return key
    if (isinstance(key, list) and len(key) == 2 and isinstance(key[0], str)
            and isinstance(key[1], int) and not isinstance(key[1], bool) and -(1 << 63) <= key[1] < 1 << 63):
        return (key[0], key[1])
    return OTHER_KEY


def _medium(where: str, medium: Any) -> None:
    if medium is not None and not isinstance(medium, str):
        raise MalformedBatch(f"{where} medium must be nil or a str, got {type_name(medium)}")


# -- applying -----------------------------------------------------------------------------------

MAX_GROUPS = 64
"""KV-cache groups per replica: events with a group_idx outside [0, MAX_GROUPS) are skipped."""

MAX_MEDIA = 64
"""Distinct medium names an applier tells apart; events naming another are skipped."""

SKIP_KINDS = ("unknown_parent", "unknown_removal", "unsupported_keys", "unsupported_group", "unsupported_medium")
"""Why a decoded event (or, for removals, one of its hashes) was skipped alone."""


class _Entry:
    """One engine block (engine hash, group) of one replica.

    start/end: its token positions in the prompt; lead: tokens before `start` that its first
    router block also covers (pages smaller than, or misaligned with, router blocks); seed:
    kvroute chain hash at the last router-block boundary <= end (the root when none);
    tail/tail_mm: the tokens (uint32 LE bytes) and multimodal items after that boundary, which
    the next engine block continues; kv: the router blocks it completes; dep: kv[0] spans
    earlier pages; media: media holding it; first_ok[t]: kv[0] counted in tier t (all its
    pages held there); dependents: engine hashes of later pages whose kv[0] spans this one."""

    __slots__ = ("parent", "start", "end", "lead", "seed", "tail", "tail_mm", "kv", "dep", "media",
                 "first_ok", "dependents", "seq", "key")
    parent: int | None
    start: int
    end: int
    lead: int
    seed: int
    tail: bytes
    tail_mm: tuple[tuple[bytes, int], ...]
    kv: tuple[int, ...]
    dep: bool
    media: set[str]
    first_ok: list[bool]
    dependents: list[int]
    seq: int
    key: int

    def has_tier(self, t: int) -> bool:
        return any(_tier(m) == t for m in self.media)


class _Group:
    """One KV-cache group of one replica: its engine blocks and, per tier, how many entries hold
    each kvroute block."""

    __slots__ = ("entries", "refs", "dead", "engine_block_size")

    def __init__(self) -> None:
        self.entries: dict[int, _Entry] = {}  # insertion order = store recency (map bound)
        self.refs: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self.dead: list[int] = []
        self.engine_block_size: int | None = None


class _Replica:
    __slots__ = ("groups", "salt", "root", "last_ts", "batches", "skipped", "k", "engine_block_size")

    def __init__(self) -> None:
        self.groups: dict[int, _Group] = {}
        self.salt: bytes | None = None  # set_salt(): this replica's chains start from its own salt
        self.root: int | None = None
        self.last_ts: float | None = None
        self.batches = 0
        self.skipped = dict.fromkeys(SKIP_KINDS, 0)
        self.k = 1
        self.engine_block_size: int | None = None


_COUNTERS = (
    "batches",
    "events",
    "ignored_events",
    "stored_blocks",
    "duplicate_stores",
    "removed_blocks",
    "unknown_removals",
    "unknown_parents",
    "unsupported_events",
    "clears",
    "malformed",
    "index_conflicts",
    "map_evictions",
)


def _tier(medium: str) -> int:
    return 0 if medium == _GPU else 1


class EventApplier:
    """Applies one fleet's engine KV events to a PrefixIndex (one index replica id per engine).

    EventApplier(index, block_size=16, *, salt=None, tier_index=None): `block_size` and
    `salt` must be the router's (config.block_size, config.salt) so that routed requests
    hash to the same blocks. `tier_index`, a second PrefixIndex, receives blocks of other
    media (CPU, disk); it gains replica ids as needed to cover the ones used. The applier
    is safe to call from several threads (one lock); the subscriber calls it from its own.
    Replica ids are the index's: when an id is removed and later handed out again
    (index.add_replica reuses ids), call clear_replica(id) before feeding the new engine.
    See the module docstring for the semantics.
    """

    def __init__(
        self,
        index: PrefixIndex,
        block_size: int = 16,
        *,
        salt: str | bytes | None = None,
        tier_index: PrefixIndex | None = None,
    ) -> None:
        if not isinstance(index, PrefixIndex):
            raise TypeError(f"index must be a PrefixIndex, got {type(index).__name__}")
        if tier_index is not None:
            if not isinstance(tier_index, PrefixIndex):
                raise TypeError(f"tier_index must be a PrefixIndex or None, got {type(tier_index).__name__}")
            if tier_index is index:
                raise ValueError("tier_index must be a different PrefixIndex than index")
        self._block_size = check_block_size(block_size)
        self._salt = salt_bytes(salt)
        self._root = xxhash.xxh3_64_intdigest(self._salt, 0)
        self._index = index
        self._tier = tier_index
        self._lock = threading.RLock()
        self._replicas: dict[int, _Replica] = {}
        self._c = dict.fromkeys(_COUNTERS, 0)
        self._last_error: str | None = None
        self._seq = 0
        self._media: set[str] = {_GPU}

    @property
    def block_size(self) -> int:
        """Tokens per kvroute block (the router's block size)."""
        return self._block_size

    @property
    def salt(self) -> bytes:
        """Bytes of the salt every replica's chains start from."""
        return self._salt

    @property
    def index(self) -> PrefixIndex:
        """The PrefixIndex that GPU blocks go to."""
        return self._index

    @property
    def tier_index(self) -> PrefixIndex | None:
        """The PrefixIndex that blocks of other media go to, or None."""
        return self._tier

    # -- public operations ------------------------------------------------------------------

    def apply(self, replica: int, payload: Any) -> bool:
        """Decode and apply one msgpack batch of the engine behind `replica`.

        True when it decoded (events that cannot be resolved are skipped alone and counted);
        False when the payload was malformed (counted, message in stats()["last_error"],
        nothing applied). Bad arguments raise, before anything changes.
        """
        with self._lock:
            r = self._check_replica(replica, mutating=True)
            try:
                batch = decode(payload)
            except MalformedBatch as exc:
                return self._malformed(str(exc))
            st = self._state(r)
            self._c["batches"] += 1
            self._c["ignored_events"] += batch.ignored
            st.batches += 1
            st.last_ts = batch.ts
            now = time.monotonic()
            with self._replica_guard(r, st):
                for ev in batch.events:
                    self._c["events"] += 1
                    if isinstance(ev, BlockStored):
                        self._stored_event(r, st, ev, now)
                    elif isinstance(ev, BlockRemoved):
                        self._removed_event(r, st, ev)
                    else:
                        self._clear(r, st)
                        self._c["clears"] += 1
            return True

    def apply_stored(
        self,
        replica: int,
        block_hashes: Any,
        parent_block_hash: int | None,
        token_ids: Any,
        *,
        block_size: int | None = None,
        medium: str | None = None,
    ) -> int:
        """Apply one BlockStored (group 0, no per-request keys) from arrays (engine hashes as
        ints, bit-cast if negative). Returns the number of engine blocks in it. Raises on bad
        arguments, KeyError for an unknown parent; nothing is applied then.
        """
        with self._lock:
            r = self._check_replica(replica, mutating=True)
            hs = as_hashes(block_hashes, "block_hashes").tolist()
            parent = None if parent_block_hash is None else as_hash(parent_block_hash, "parent_block_hash")
            tokens = tokens_as_uint32(token_ids)
            self._medium_arg(medium)
            size = 0 if block_size is None else check_block_size(block_size)
            self._medium_limit(medium)
            if size == 0 and hs and len(tokens) and len(tokens) % len(hs) == 0:
                size = len(tokens) // len(hs)
            if size == 0 or len(tokens) != len(hs) * size:
                raise ValueError(f"{len(tokens)} token_ids do not make {len(hs)} blocks"
                                 + (f" of {size} tokens" if size else ""))
            st = self._state(r)
            g = st.groups.get(0)
            if parent is not None and (g is None or parent not in g.entries):
                raise KeyError(f"parent block hash {parent} is unknown on replica {r}")
            self._known_medium(medium)
            with self._replica_guard(r, st):
                g = self._group(r, st, 0)
                self._learn_size(r, st, g, size)
                self._store(r, st, g, hs, parent, tokens, size, medium, (b"", b"", None), time.monotonic())
            return len(hs)

    def apply_removed(self, replica: int, block_hashes: Any, *, medium: str | None = None) -> int:
        """Apply one BlockRemoved (group 0) from an array of engine hashes; returns blocks removed."""
        with self._lock:
            r = self._check_replica(replica, mutating=True)
            hs = as_hashes(block_hashes, "block_hashes").tolist()
            self._medium_arg(medium)
            self._medium_limit(medium)
            self._known_medium(medium)
            st = self._state(r)
            with self._replica_guard(r, st):
                return self._removed(r, st, 0, hs, medium)

    def set_salt(self, replica: int, salt: str | bytes | None) -> None:
        """Give the replica its own salt (None: the applier's again), for example a model or
        tenant it alone serves. Chains that start after the call use it; call it before
        feeding the replica's events."""
        with self._lock:
            r = self._check_replica(replica)
            st = self._state(r)
            if salt is None:
                st.salt = st.root = None
            else:
                st.salt = salt_bytes(salt)
                st.root = xxhash.xxh3_64_intdigest(st.salt, 0)

    def clear_replica(self, replica: int) -> None:
        """Forget everything about the replica (a resync): its maps and its blocks in both
        indexes. Its salt, counters and engine block (k on the index) stay: a resync does not
        change the engine's configuration, and the next store sets k again anyway."""
        with self._lock:
            r = self._check_replica(replica, mutating=True)
            st = self._state(r)
            self._clear(r, st)

    def export_replica(self, replica: int) -> bytes:
        """The replica's state (maps per KV-cache group, reference counts, own salt, learned
        engine block size, counters) as bytes that import_replica() takes back, for snapshots
        (layout: docs/snapshot-format.md, "Applier state"). Refused (ValueError) with a
        tier_index: the tier index's contents are not part of a snapshot."""
        from . import events_state

        with self._lock:
            r = self._check_replica(replica)
            self._refuse_tier()
            return events_state.encode(self, r)

    def import_replica(self, replica: int, state: bytes) -> None:
        """Replace the replica's state with an export_replica() result, so that later events
        (removals of blocks stored before the export included) apply as they would have.
        The index is not touched: restore its contents (PrefixIndex.import_replica) and
        engine block with it. ValueError, nothing changed, when `state` is cut short,
        malformed, or written for another block size or salt, or with a tier_index."""
        from . import events_state

        with self._lock:
            r = self._check_replica(replica, mutating=True)
            if not isinstance(state, (bytes, bytearray, memoryview)):
                raise TypeError(f"state must be bytes, got {type(state).__name__}")
            self._refuse_tier()
            decoded = events_state.decode(bytes(state), self._block_size, self._salt)
            known = self._media | set(decoded["media"])
            if len(known) > MAX_MEDIA:
                raise ValueError(f"applier state names too many media: an applier tells at most {MAX_MEDIA} apart")
            events_state.install(self, r, decoded)

    def _refuse_tier(self) -> None:
        if self._tier is not None:
            raise ValueError("an applier with a tier_index cannot be exported or imported "
                             "(the tier index is not part of a snapshot)")

    def stats(self) -> dict[str, Any]:
        """Counters over all replicas: batches, events, ignored_events (unknown types),
        stored_blocks, duplicate_stores, removed_blocks, unknown_removals, unknown_parents,
        unsupported_events, clears, malformed, index_conflicts, map_evictions, and
        last_error (message of the last malformed batch, or None)."""
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            out["last_error"] = self._last_error
            return out

    def replica_stats(self, replica: int) -> dict[str, Any]:
        """One replica: batches, engine_blocks (engine blocks in its maps, all groups),
        index_blocks / tier_blocks (kvroute blocks the index / tier index holds for it),
        engine_block_size (last seen), engine_block (router blocks per engine block, as set
        on the index), groups (KV-cache groups seen), skipped (events skipped alone, by kind;
        removals count per hash), last_ts (engine time of the last batch), salt (bytes its
        chains start from)."""
        with self._lock:
            r = self._check_replica(replica)
            st = self._replicas.get(r) or _Replica()
            tier = self._tier
            return {
                "batches": st.batches,
                "engine_blocks": sum(len(g.entries) for g in st.groups.values()),
                "index_blocks": self._index.blocks(r),
                "tier_blocks": self._tier_blocks(r),
                "engine_block_size": st.engine_block_size,
                "engine_block": self._index.engine_block(r),
                "groups": sorted(st.groups),
                "skipped": dict(st.skipped),
                "last_ts": st.last_ts,
                "salt": self._salt if st.salt is None else st.salt,
            }

    def __repr__(self) -> str:
        return f"EventApplier(block_size={self._block_size})"

    def _tier_blocks(self, r: int) -> int:
        tier = self._tier
        if tier is None or r >= tier.num_replicas:
            return 0
        try:
            return tier.blocks(r)
        except IndexError:  # removed from the tier index only
            return 0

    # -- checks -------------------------------------------------------------------------------

    def _check_replica(self, replica: Any, mutating: bool = False) -> int:
        if isinstance(replica, (bool, np.bool_)):
            raise TypeError(f"replica must be an int, got {type(replica).__name__}")
        try:
            r = operator.index(replica)
        except TypeError:
            raise TypeError(f"replica must be an int, got {type(replica).__name__}") from None
        self._index.blocks(r)  # the index's own IndexError for out-of-range or removed ids
        if mutating and self._tier is not None and 0 <= r < self._tier.num_replicas:
            self._tier.blocks(r)  # removed from the tier index: refuse before changing anything
        return r

    @contextlib.contextmanager
    def _replica_guard(self, r: int, st: _Replica) -> Iterator[None]:
        """Purges dead entries after the operation; when an index refuses the replica midway
        (remove_replica raced this call), forgets it, so nothing of the call stays."""
        try:
            yield
        except IndexError:
            self._forget(r, st)
            raise
        finally:
            for g in st.groups.values():
                _purge(g)

    def _forget(self, r: int, st: _Replica) -> None:
        st.groups.clear()
        for ix in (self._index, self._tier):
            if ix is not None and r < ix.num_replicas:
                try:
                    ix.clear_replica(r)
                except IndexError:
                    pass  # removed: it holds nothing of r

    def _state(self, r: int) -> _Replica:
        st = self._replicas.get(r)
        if st is None:
            st = self._replicas[r] = _Replica()
        return st

    def _malformed(self, message: str) -> bool:
        self._c["malformed"] += 1
        self._last_error = message
        return False

    def _skip(self, st: _Replica, kind: str, n: int = 1) -> None:
        st.skipped[kind] += n
        counter = {"unknown_parent": "unknown_parents", "unknown_removal": "unknown_removals"}.get(
            kind, "unsupported_events")
        self._c[counter] += n

    # -- events -------------------------------------------------------------------------------

    def _stored_event(self, r: int, st: _Replica, ev: BlockStored, now: float) -> None:
        gid = 0 if ev.group_idx is None else ev.group_idx
        if not 0 <= gid < MAX_GROUPS:
            return self._skip(st, "unsupported_group")
        if not self._known_medium(ev.medium):
            return self._skip(st, "unsupported_medium")
        keys = _event_keys(ev)
        if keys is None:
            return self._skip(st, "unsupported_keys")
        g = st.groups.get(gid)
        if ev.parent_block_hash is not None and (g is None or ev.parent_block_hash not in g.entries):
            return self._skip(st, "unknown_parent")
        if not ev.block_hashes:
            return None
        size = _engine_size(ev)
        g = self._group(r, st, gid)
        self._learn_size(r, st, g, size)
        tokens = np.asarray(ev.token_ids, dtype="<u4")
        self._store(r, st, g, ev.block_hashes, ev.parent_block_hash, tokens, size, ev.medium, keys, now)
        return None

    def _removed_event(self, r: int, st: _Replica, ev: BlockRemoved) -> None:
        gid = 0 if ev.group_idx is None else ev.group_idx
        if not 0 <= gid < MAX_GROUPS:
            return self._skip(st, "unsupported_group")
        if not self._known_medium(ev.medium):
            return self._skip(st, "unsupported_medium")
        self._removed(r, st, gid, ev.block_hashes, ev.medium)
        return None

    def _known_medium(self, medium: str | None) -> bool:
        """Registers a medium name; False once MAX_MEDIA names are known and this is new."""
        if medium is None or medium in self._media:
            return True
        if len(self._media) >= MAX_MEDIA:
            return False
        self._media.add(medium)
        return True

    @staticmethod
    def _medium_arg(medium: Any) -> None:
        if medium is not None and not isinstance(medium, str):
            raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
        if medium is not None:
            check_text(medium, "medium")

    def _medium_limit(self, medium: str | None) -> None:
        if medium is not None and medium not in self._media and len(self._media) >= MAX_MEDIA:
            raise ValueError(f"medium is one too many: an applier tells at most {MAX_MEDIA} media apart")

    # -- groups and block sizes -----------------------------------------------------------------

    def _group(self, r: int, st: _Replica, gid: int) -> _Group:
        g = st.groups.get(gid)
        if g is None:
            if st.groups:
                # A replica's index holds the blocks every group holds; a new group holds none.
                self._clear_indexes(r)
            g = st.groups[gid] = _Group()
        return g

    def _learn_size(self, r: int, st: _Replica, g: _Group, size: int) -> None:
        g.engine_block_size = size
        st.engine_block_size = size
        k = 1
        for o in st.groups.values():
            e = o.engine_block_size
            if e is not None and e % self._block_size == 0:
                k = math.lcm(k, e // self._block_size)
        self._set_k(r, st, min(k, MAX_ENGINE_BLOCK))

    def _set_k(self, r: int, st: _Replica, k: int) -> None:
        st.k = k
        if k == self._index.engine_block(r):  # learned before, or configured on the router
            return
        self._index.set_engine_block(r, k)
        if self._tier is not None:
            self._grow(self._tier, r)
            self._tier.set_engine_block(r, k)

    # -- storing ------------------------------------------------------------------------------

    def _store(self, r: int, st: _Replica, g: _Group, hs: Any, parent: int | None, tokens: np.ndarray,
               size: int, medium: str | None, keys: tuple[bytes, bytes, Any], now: float) -> None:
        m = _GPU if medium is None else medium
        t = _tier(m)
        entries = g.entries
        if parent is None:
            r0 = self._root if st.root is None else st.root
            state: tuple[int, int, bytes, tuple[Any, ...]] = (0, keyed_root(r0, keys[0], keys[1]), b"", ())
        else:
            p = entries[parent]
            state = (p.end, p.seed, p.tail, p.tail_mm)
        pred = None if state[0] - len(state[2]) // 4 == 0 else state[1]
        per_block = keys[2]
        chain: list[int] = []
        prev = parent
        for j, h in enumerate(hs):
            e = entries.get(h)
            if e is None:
                mm = per_block[j] if per_block is not None and j < len(per_block) else ()
                e = self._new_entry(g, h, prev, state, tokens[j * size : (j + 1) * size], mm)
            else:
                del entries[h]  # re-inserted below: a repeated store refreshes its recency
            entries[h] = e
            self._seq += 1
            e.seq = self._seq
            if m in e.media:
                self._c["duplicate_stores"] += 1
            else:
                held = e.has_tier(t)
                e.media.add(m)
                if not held:
                    self._hold(g, e, t)
                self._c["stored_blocks"] += 1
            chain.extend(e.kv)
            state = (e.end, e.seed, e.tail, e.tail_mm)
            prev = h
        self._index_chain(r, st, t, pred, chain, now)
        self._bound(r, st, g)

    def _new_entry(self, g: _Group, h: int, parent: int | None, state: tuple[int, int, bytes, tuple[Any, ...]],
                   tokens: np.ndarray, mm: Any) -> _Entry:
        pos, seed, tail, tail_mm = state
        bs = self._block_size
        lead = len(tail) // 4
        b = pos - lead
        # By offset; ties: carried items first, then the block's keys in order (stable sort).
        items = sorted(list(tail_mm) + [(ident, pos + rel) for ident, rel in mm if rel >= 0], key=lambda it: it[1])
        buf = tail + tokens.tobytes()
        n = len(buf) // 4 // bs
        kv = chain_keyed(buf[: n * bs * 4], bs, seed, b, items) if n else []
        e = _Entry()
        e.parent, e.start, e.end, e.lead = parent, pos, pos + len(tokens), lead
        e.kv = tuple(kv)
        e.seed = kv[-1] if kv else seed
        e.tail = buf[n * bs * 4 :]
        e.tail_mm = tuple(it for it in items if it[1] >= b + n * bs)
        e.dep = lead > 0 and n > 0
        e.media = set()
        e.first_ok = [False, False]
        e.dependents = []
        e.seq = 0
        e.key = h
        return e

    @staticmethod
    def _span(g: _Group, e: _Entry) -> list[_Entry | None]:
        """The earlier pages e's first router block spans (None where the chain is broken)."""
        out: list[_Entry | None] = []
        b = e.start - e.lead
        cur = e
        while cur.start > b:
            p = g.entries.get(cur.parent) if cur.parent is not None else None
            out.append(p)
            if p is None:
                break
            cur = p
        return out

    def _hold(self, g: _Group, e: _Entry, t: int) -> None:
        """e gained tier t: count its router blocks there (kv[0] only if all its pages are)."""
        if e.dep:
            span = self._span(g, e)
            e.first_ok[t] = all(a is not None and a.has_tier(t) for a in span)
            if e.first_ok[t]:
                for a in span:
                    assert a is not None
                    if e.key not in a.dependents:  # a's loss must uncount e's first block
                        a.dependents.append(e.key)
        refs = g.refs[t]
        for q, x in enumerate(e.kv):
            if q == 0 and e.dep and not e.first_ok[t]:
                continue
            refs[x] = refs.get(x, 0) + 1

    def _index_chain(self, r: int, st: _Replica, t: int, pred: int | None, chain: list[int], now: float) -> None:
        """Hands the index the chain's blocks this replica now holds in every group, in runs."""
        target = self._index if t == 0 else self._tier
        if target is None or not chain:
            return
        self._grow(target, r)
        groups = list(st.groups.values())
        run: list[int] = []
        run_pred = last = pred
        for x in chain:
            if all(o.refs[t].get(x, 0) > 0 for o in groups):
                if not run:
                    run_pred = last
                run.append(x)
            elif run:
                self._insert(target, r, run_pred, run, now)
                run = []
            last = x
        if run:
            self._insert(target, r, run_pred, run, now)

    def _insert(self, target: PrefixIndex, r: int, pred: int | None, run: list[int], now: float) -> None:
        try:
            if pred is None:
                target.insert(r, run, now)
            else:
                target.store_after(r, pred, run, now)
        except (KeyError, ValueError):
            self._c["index_conflicts"] += 1

    def _bound(self, r: int, st: _Replica, g: _Group) -> None:
        """Keeps the group's map within what the index can hold (its capacity in router
        blocks, times the engine blocks per router block): the oldest-stored entries go, and
        their blocks leave the index too, so the index never holds a block the map forgot."""
        cap = self._index.capacity
        if cap is None or g.engine_block_size is None:
            return
        limit = cap * max(1, -(-self._block_size // g.engine_block_size))
        if len(g.entries) <= limit:
            return
        gone: tuple[list[int], list[int]] = ([], [])
        while len(g.entries) > limit:
            h = next(iter(g.entries))
            e = g.entries.pop(h)
            for t in (0, 1):
                if e.has_tier(t):
                    self._release(st, g, e, t, gone[t])
            e.media.clear()
            self._c["map_evictions"] += 1
        self._drop(r, gone)

    # -- removing -----------------------------------------------------------------------------

    def _removed(self, r: int, st: _Replica, gid: int, hs: Any, medium: str | None) -> int:
        m = _GPU if medium is None else medium
        t = _tier(m)
        g = st.groups.get(gid)
        gone: tuple[list[int], list[int]] = ([], [])
        done = 0
        for h in hs:
            e = None if g is None else g.entries.get(h)
            if e is None or m not in e.media:
                self._skip(st, "unknown_removal")
                continue
            assert g is not None
            e.media.discard(m)
            if not e.has_tier(t):
                self._release(st, g, e, t, gone[t])
            if not e.media:
                g.dead.append(h)
            done += 1
        self._c["removed_blocks"] += done
        self._drop(r, gone)
        return done

    def _release(self, st: _Replica, g: _Group, e: _Entry, t: int, gone: list[int]) -> None:
        """e lost tier t: uncount its router blocks there, and the first router block of every
        later page that spans it."""
        for q, x in enumerate(e.kv):
            if q == 0 and e.dep and not e.first_ok[t]:
                continue
            self._unref(st, g, t, x, gone)
        e.first_ok[t] = False
        for d in e.dependents:
            de = g.entries.get(d)
            if de is not None and de.dep and de.first_ok[t]:
                self._unref(st, g, t, de.kv[0], gone)
                de.first_ok[t] = False

    @staticmethod
    def _unref(st: _Replica, g: _Group, t: int, x: int, gone: list[int]) -> None:
        refs = g.refs[t]
        c = refs[x]
        if c > 1:
            refs[x] = c - 1
            return
        del refs[x]
        if all(o.refs[t].get(x, 0) > 0 for o in st.groups.values() if o is not g):
            gone.append(x)  # it was in the index: every other group holds it

    def _drop(self, r: int, gone: tuple[list[int], list[int]]) -> None:
        for t, target in ((0, self._index), (1, self._tier)):
            if gone[t] and target is not None:
                self._grow(target, r)
                target.remove(r, gone[t])

    def _clear(self, r: int, st: _Replica) -> None:
        st.groups.clear()
        self._clear_indexes(r)

    def _clear_indexes(self, r: int) -> None:
        self._index.clear_replica(r)
        if self._tier is not None:
            self._grow(self._tier, r)
            self._tier.clear_replica(r)

    @staticmethod
    def _grow(index: PrefixIndex, r: int) -> None:
        while index.num_replicas <= r:
            index.add_replica()


def _purge(g: _Group) -> None:
    # Entries whose last medium went during the call stay until its end so that a later
    # store of the same batch can name them as parent; then they go.
    for h in g.dead:
        e = g.entries.get(h)
        if e is not None and not e.media:
            del g.entries[h]
    g.dead.clear()


def _event_keys(ev: BlockStored) -> tuple[bytes, bytes, list[list[tuple[bytes, int]]] | None] | None:
    """(lora, cache_salt, per-block multimodal (identifier, relative offset)) of a store, as
    the hash contract takes them; None when a key cannot be reproduced (prompt-embedding
    digests, identifiers without offsets, ints), so the event is skipped."""
    lora = ev.lora_name or ""
    salt = ev.cache_salt or ""
    if ev.extra_keys is None:
        return lora.encode("utf-8"), salt.encode("utf-8"), None
    per_block: list[list[tuple[bytes, int]]] = []
    for j in range(len(ev.block_hashes)):
        keys = ev.extra_keys[j] if j < len(ev.extra_keys) else None
        mm: list[tuple[bytes, int]] = []
        strs: list[str] = []
        lora_seen = False
        for key in keys or ():
            if key is OTHER_KEY:
                return None
            if isinstance(key, tuple):
                mm.append((key[0].encode("utf-8"), key[1]))
            elif lora and key == lora and not lora_seen:
                lora_seen = True
            else:
                strs.append(key)
        if strs:
            # vLLM puts the cache_salt on the prompt's first block only.
            if j == 0 and ev.parent_block_hash is None and len(strs) == 1 and salt in ("", strs[0]):
                salt = strs[0]
            else:
                return None
        per_block.append(mm)
    return lora.encode("utf-8"), salt.encode("utf-8"), per_block


def _engine_size(ev: BlockStored) -> int:
    if ev.block_size is not None:
        return ev.block_size
    return len(ev.token_ids) // len(ev.block_hashes) if ev.block_hashes else 0


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventApplier",
    "EventBatch",
    "MAX_DEPTH",
    "MAX_GROUPS",
    "MAX_MEDIA",
    "MalformedBatch",
    "OTHER_KEY",
    "SKIP_KINDS",
    "decode",
    "normalize_hash",
]
