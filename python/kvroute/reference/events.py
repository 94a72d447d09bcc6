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

Applying (`EventApplier`) keeps, per replica, a map engine hash -> kvroute hashes and
reference counts, and mirrors the engine's GPU blocks into a PrefixIndex:

- BlockStored: each engine block of E tokens becomes E / block_size kvroute blocks, chained
  (kvroute.block_hashes) from the parent's last kvroute hash, or from the root hash of
  `salt` when there is no parent. An engine block size that is not a multiple of
  block_size makes the replica unusable: its blocks are dropped from the indexes, its
  events are ignored until clear_replica(), and the reason is logged once and shown in
  replica_stats()["unusable"].
- Reference counts are kept per (engine hash, medium): a hash stored twice needs two
  removals. A kvroute hash is held while any engine block maps to it in that tier.
- medium None or "GPU" goes to `index`; any other medium ("CPU", "CPU_PINNED", "DISK",
  "STORAGE", ...) goes to `tier_index` when one is given (a second PrefixIndex a router may
  weigh), else it is only counted.
- BlockRemoved resolves engine hashes through the map; a hash not held in that medium is
  counted in unknown_removals. AllBlocksCleared drops all of the replica's blocks, in every
  medium.
- Extra keys (LoRA name, multimodal hashes, cache_salt) are not part of kvroute hashes:
  a replica's blocks chain from its one salt.
- apply(replica, payload) validates the whole batch first (including that every parent is
  known, from before or from earlier in the batch); a malformed batch is counted, its
  message kept in stats()["last_error"], and nothing of it is applied.
- If the index refuses a chain (its parent was evicted by capacity, or an engine hash maps to
  a chain that conflicts with the index), the blocks are kept in the map but not indexed,
  counted in index_conflicts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import threading
import time
from typing import Any

import numpy as np
import xxhash

from .args import check_text
from .hashing import check_block_size, salt_bytes, tokens_as_uint32
from .index import PrefixIndex, as_hash, as_hashes

_LOG = logging.getLogger("kvroute.events")
_U64 = 1 << 64
_MASK64 = _U64 - 1
_TOKEN_LIMIT = 1 << 32
_GPU = "GPU"


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch; the message names the first problem."""


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Blocks the engine now holds: hashes normalized to uint64, tokens flattened."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int | None
    medium: str | None = None
    lora_id: Any = None
    lora_name: Any = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks the engine stopped holding (one BlockStored each), hashes normalized to uint64."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


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
    return _batch(obj)


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


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


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
        hashes, parent, tokens, size, lora_id, medium, lora_name = _fields(ev, _STORED_FIELDS)
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
        # Informational only (kvroute hashes ignore LoRA); SGLang puts its salt map where vLLM
        # has lora_name, so keep just the types vLLM sends.
        lora_id = lora_id if isinstance(lora_id, int) and not isinstance(lora_id, bool) else None
        lora_name = lora_name if isinstance(lora_name, str) else None
        return BlockStored(tuple(hs), parent, tuple(tokens), size, medium, lora_id, lora_name)
    if tag == "BlockRemoved":
        hashes, medium = _fields(ev, _REMOVED_FIELDS)
        where = f"event {i} (BlockRemoved)"
        hs = _hashes(where, hashes)
        _medium(where, medium)
        return BlockRemoved(tuple(hs), medium)
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


def _medium(where: str, medium: Any) -> None:
    if medium is not None and not isinstance(medium, str):
        raise MalformedBatch(f"{where} medium must be nil or a str, got {type_name(medium)}")


# -- applying -----------------------------------------------------------------------------------


class _Entry:
    """One engine hash on one replica: its kvroute hashes and live count per medium."""

    __slots__ = ("kv", "counts")

    def __init__(self, kv: tuple[int, ...]) -> None:
        self.kv = kv
        self.counts: dict[str, int] = {}


class _Replica:
    __slots__ = ("entries", "dead", "refs", "engine_block_size", "unusable", "last_ts", "batches", "salt", "root")

    def __init__(self) -> None:
        self.salt: bytes | None = None  # set_salt(): this replica's chains start from its own salt
        self.root: int | None = None
        self.entries: dict[int, _Entry] = {}
        self.dead: list[int] = []  # engine hashes whose last count went, purged after the batch
        # kvroute hash -> engine blocks mapping to it, for tier 0 (GPU) and tier 1 (others).
        self.refs: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self.engine_block_size: int | None = None
        self.unusable: str | None = None
        self.last_ts: float | None = None
        self.batches = 0


_COUNTERS = (
    "batches",
    "events",
    "ignored_events",
    "stored_blocks",
    "removed_blocks",
    "unknown_removals",
    "clears",
    "malformed",
    "ignored_batches",
    "index_conflicts",
)


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

        True when applied; False when the payload was malformed (counted, message in
        stats()["last_error"], nothing applied). Bad arguments raise.
        """
        with self._lock:
            r = self._check_replica(replica)
            try:
                batch = decode(payload)
            except MalformedBatch as exc:
                return self._malformed(str(exc))
            st = self._state(r)
            if st.unusable is not None:
                self._c["ignored_batches"] += 1
                st.last_ts = batch.ts
                return True
            problem = self._check_semantics(r, st, batch)
            if problem is not None:
                return self._malformed(problem)
            self._c["batches"] += 1
            self._c["ignored_events"] += batch.ignored
            st.batches += 1
            st.last_ts = batch.ts
            now = time.monotonic()
            for ev in batch.events:
                if st.unusable is not None:
                    break
                self._c["events"] += 1
                if isinstance(ev, BlockStored):
                    self._stored(r, st, ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                 _engine_size(ev), ev.medium, now)
                elif isinstance(ev, BlockRemoved):
                    self._removed(r, st, ev.block_hashes, ev.medium)
                else:
                    self._clear(r, st)
                    self._c["clears"] += 1
            self._purge(st)
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
        """Apply one BlockStored from arrays (engine hashes as ints, bit-cast if negative).

        Returns the number of engine blocks stored (0 when the replica is or becomes
        unusable). Raises on bad arguments, KeyError for an unknown parent; nothing is
        applied then.
        """
        with self._lock:
            r = self._check_replica(replica)
            hs = as_hashes(block_hashes, "block_hashes").tolist()
            parent = None if parent_block_hash is None else as_hash(parent_block_hash, "parent_block_hash")
            tokens = tokens_as_uint32(token_ids)
            if medium is not None and not isinstance(medium, str):
                raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
            if medium is not None:
                check_text(medium, "medium")
            if block_size is not None:
                size = check_block_size(block_size)
            elif hs and len(tokens) and len(tokens) % len(hs) == 0:
                size = len(tokens) // len(hs)
            else:
                size = 0
            if size == 0 or len(tokens) != len(hs) * size:
                raise ValueError(f"{len(tokens)} token_ids do not make {len(hs)} blocks"
                                 + (f" of {size} tokens" if size else ""))
            st = self._state(r)
            if st.unusable is not None:
                return 0
            if parent is not None and parent not in st.entries:
                raise KeyError(f"parent block hash {parent} is unknown on replica {r}")
            if self._mismatch(r, st, size):
                return 0
            self._stored(r, st, hs, parent, tokens.tolist(), size, medium, time.monotonic())
            return len(hs)

    def apply_removed(self, replica: int, block_hashes: Any, *, medium: str | None = None) -> int:
        """Apply one BlockRemoved from an array of engine hashes; returns blocks removed."""
        with self._lock:
            r = self._check_replica(replica)
            hs = as_hashes(block_hashes, "block_hashes").tolist()
            if medium is not None and not isinstance(medium, str):
                raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
            if medium is not None:
                check_text(medium, "medium")
            st = self._state(r)
            if st.unusable is not None:
                return 0
            done = self._removed(r, st, hs, medium)
            self._purge(st)
            return done

    def set_salt(self, replica: int, salt: str | bytes | None) -> None:
        """Give the replica its own salt (None: the applier's again), for example a LoRA
        adapter or tenant it alone serves. Chains that start after the call use it; call it
        before feeding the replica's events."""
        with self._lock:
            r = self._check_replica(replica)
            st = self._state(r)
            if salt is None:
                st.salt = st.root = None
            else:
                st.salt = salt_bytes(salt)
                st.root = xxhash.xxh3_64_intdigest(st.salt, 0)

    def clear_replica(self, replica: int) -> None:
        """Forget everything about the replica (a resync): its map, its blocks in both
        indexes, and an unusable mark."""
        with self._lock:
            r = self._check_replica(replica)
            st = self._state(r)
            self._clear(r, st)
            st.unusable = None
            st.engine_block_size = None

    def stats(self) -> dict[str, Any]:
        """Counters over all replicas: batches, events, ignored_events, stored_blocks,
        removed_blocks, unknown_removals, clears, malformed, ignored_batches,
        index_conflicts, and last_error (message of the last malformed batch, or None)."""
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            out["last_error"] = self._last_error
            return out

    def replica_stats(self, replica: int) -> dict[str, Any]:
        """One replica: batches, engine_blocks (engine hashes in the map), index_blocks
        (kvroute blocks held in the GPU tier), tier_blocks (other media), engine_block_size
        (last seen), unusable (reason or None), last_ts (engine time of the last batch),
        salt (bytes its chains start from)."""
        with self._lock:
            r = self._check_replica(replica)
            st = self._replicas.get(r) or _Replica()
            return {
                "batches": st.batches,
                "engine_blocks": len(st.entries),
                "index_blocks": len(st.refs[0]),
                "tier_blocks": len(st.refs[1]),
                "engine_block_size": st.engine_block_size,
                "unusable": st.unusable,
                "last_ts": st.last_ts,
                "salt": self._salt if st.salt is None else st.salt,
            }

    def __repr__(self) -> str:
        return f"EventApplier(block_size={self._block_size})"

    # -- internals ----------------------------------------------------------------------------

    def _check_replica(self, replica: Any) -> int:
        if isinstance(replica, (bool, np.bool_)):
            raise TypeError(f"replica must be an int, got {type(replica).__name__}")
        try:
            r = operator.index(replica)
        except TypeError:
            raise TypeError(f"replica must be an int, got {type(replica).__name__}") from None
        self._index.blocks(r)  # the index's own IndexError for out-of-range or removed ids
        return r

    def _state(self, r: int) -> _Replica:
        st = self._replicas.get(r)
        if st is None:
            st = self._replicas[r] = _Replica()
        return st

    def _malformed(self, message: str) -> bool:
        self._c["malformed"] += 1
        self._last_error = message
        return False

    def _check_semantics(self, r: int, st: _Replica, batch: EventBatch) -> str | None:
        """The first unknown parent of the batch, as a message; None when all are known."""
        entries_valid = True
        stored: set[int] = set()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                p = ev.parent_block_hash
                if p is not None and p not in stored and not (entries_valid and p in st.entries):
                    return f"BlockStored parent_block_hash {p} is unknown on replica {r}"
                stored.update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                entries_valid = False
                stored.clear()
        return None

    def _mismatch(self, r: int, st: _Replica, size: int) -> bool:
        """Marks the replica unusable when the engine block size does not fit ours."""
        st.engine_block_size = size
        if size % self._block_size == 0:
            return False
        self._clear(r, st)
        st.unusable = (
            f"replica {r}: engine block_size {size} is not a multiple of block_size "
            f"{self._block_size}; its KV events are ignored and it gets no cache affinity"
        )
        _LOG.error("kvroute.events: %s", st.unusable)
        return True

    def _stored(self, r: int, st: _Replica, hs: Any, parent: int | None, tokens: Any,
                size: int, medium: str | None, now: float) -> None:
        if not hs or self._mismatch(r, st, size):
            return
        m = _GPU if medium is None else medium
        tier = 0 if m == _GPU else 1
        refs = st.refs[tier]
        entries = st.entries
        if parent is None:
            seed = self._root if st.root is None else st.root
            pred: int | None = None
        else:
            seed = entries[parent].kv[-1]
            pred = seed
        bs = self._block_size
        k = size // bs
        raw = None
        chain: list[int] = []
        fresh = False
        for j, h in enumerate(hs):
            e = entries.get(h)
            if e is None:
                if raw is None:
                    raw = np.asarray(tokens, dtype="<u4").tobytes()
                kv = []
                base = j * size * 4
                for q in range(k):
                    seed = xxhash.xxh3_64_intdigest(raw[base + q * bs * 4 : base + (q + 1) * bs * 4], seed)
                    kv.append(seed)
                e = entries[h] = _Entry(tuple(kv))
            e.counts[m] = e.counts.get(m, 0) + 1
            for x in e.kv:
                n = refs.get(x, 0)
                refs[x] = n + 1
                if n == 0:
                    fresh = True
            chain.extend(e.kv)
            seed = e.kv[-1]
        self._c["stored_blocks"] += len(hs)
        target = self._index if tier == 0 else self._tier
        if not fresh or target is None:
            return
        self._grow(target, r)
        try:
            if pred is None:
                target.insert(r, chain, now)
            else:
                target.store_after(r, pred, chain, now)
        except (KeyError, ValueError):
            self._c["index_conflicts"] += 1

    def _removed(self, r: int, st: _Replica, hs: Any, medium: str | None) -> int:
        m = _GPU if medium is None else medium
        tier = 0 if m == _GPU else 1
        refs = st.refs[tier]
        gone: list[int] = []
        done = 0
        for h in hs:
            e = st.entries.get(h)
            n = 0 if e is None else e.counts.get(m, 0)
            if n == 0:
                self._c["unknown_removals"] += 1
                continue
            assert e is not None
            if n == 1:
                del e.counts[m]
                if not e.counts:
                    st.dead.append(h)
            else:
                e.counts[m] = n - 1
            for x in e.kv:
                c = refs[x]
                if c == 1:
                    del refs[x]
                    gone.append(x)
                else:
                    refs[x] = c - 1
            done += 1
        self._c["removed_blocks"] += done
        target = self._index if tier == 0 else self._tier
        if gone and target is not None:
            self._grow(target, r)
            target.remove(r, gone)
        return done

    def _clear(self, r: int, st: _Replica) -> None:
        st.entries.clear()
        st.dead.clear()
        st.refs[0].clear()
        st.refs[1].clear()
        self._index.clear_replica(r)
        if self._tier is not None:
            self._grow(self._tier, r)
            self._tier.clear_replica(r)

    @staticmethod
    def _purge(st: _Replica) -> None:
        # Entries whose last count went during the batch stay until its end so that a later
        # store of the same batch can name them as parent; then they go.
        for h in st.dead:
            e = st.entries.get(h)
            if e is not None and not e.counts:
                del st.entries[h]
        st.dead.clear()

    @staticmethod
    def _grow(index: PrefixIndex, r: int) -> None:
        while index.num_replicas <= r:
            index.add_replica()


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
    "MalformedBatch",
    "decode",
    "normalize_hash",
]
