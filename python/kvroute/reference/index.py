"""Prefix index, reference twin of cpp/src/prefix_index.cpp.

Which replica holds which KV blocks. The native core stores this as a compressed radix tree
(runs of blocks with one owner bitset per run); this twin stores one record per block
(parent hash, owner bitmask, child count) and derives the same answers, including the number
of radix-tree nodes the core must have.
"""

from __future__ import annotations

import array
import math
import operator
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from .args import int_buffer, refuse_masked

MAX_REPLICAS = 65536
MAX_ENGINE_BLOCK = 65536  # set_engine_block's largest k (router blocks per engine block)
"""Most replica ids one index can have."""

EVICTION_LOG_LIMIT = 1 << 20
"""Most (replica, hash) pairs the eviction log keeps between pop_evictions() calls."""

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_MASK64 = _U64 - 1
_CAPACITY_LIMIT = 1 << 63


def as_hashes(hashes: Any, name: str = "hashes") -> np.ndarray:
    """Validate a hashes argument and return it as a 1-D uint64 array.

    Accepts a 1-D numpy array of an integer dtype, a list or tuple of ints, or an
    array.array of an integer typecode. Signed values are bit-cast (two's complement) to
    uint64, as engines that emit signed 64-bit hashes expect; ints must therefore lie in
    [-2**63, 2**64).
    """
    if isinstance(hashes, np.ndarray):
        return _array_as_uint64(hashes, name)
    if isinstance(hashes, array.array):
        if hashes.typecode not in "bBhHiIlLqQ":
            raise TypeError(
                f"{name} must have an integer dtype, got array.array of typecode {hashes.typecode!r}"
            )
        return np.frombuffer(hashes, dtype=np.dtype(hashes.typecode)).astype(np.uint64)
    if isinstance(hashes, (list, tuple)):
        hashes = tuple(hashes)  # a snapshot: an item's __index__ may resize a list
        out = np.empty(len(hashes), dtype=np.uint64)
        for i, value in enumerate(hashes):
            if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
                raise TypeError(f"{name}[{i}] must be an int, got {type(value).__name__}")
            v = operator.index(value)
            if not _I64_MIN <= v < _U64:
                raise ValueError(f"hash {v} at index {i} is out of range [-2**63, 2**64)")
            out[i] = v & _MASK64
        return out
    buffered = int_buffer(hashes)  # memoryview or another exporter, read in place
    if buffered is not None:
        return _array_as_uint64(buffered, name)
    raise TypeError(
        f"{name} must be a 1-D integer numpy array, a list or tuple of ints, or an "
        f"array.array, got {type(hashes).__name__}"
    )


def as_hash(value: Any, name: str) -> int:
    """One hash as an int in [0, 2**64): an int in [-2**63, 2**64), bit-cast if negative."""
    if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    v = operator.index(value)
    if not _I64_MIN <= v < _U64:
        raise ValueError(f"{name} {v} is out of range [-2**63, 2**64)")
    return v & _MASK64


class _Block:
    """One block: its parent's hash (None at the root), owner bitmask, number of children."""

    __slots__ = ("parent", "owners", "children")

    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.owners = 0
        self.children = 0


class PrefixIndex:
    """Which replica holds which KV blocks, answering longest-prefix matches for all at once.

    A block is its chained hash (kvroute.block_hashes), which encodes its whole prefix.
    Replicas have dense ids 0..num_replicas-1.

    - insert(r, hashes): r holds the chain `hashes`, which starts at the root (block 0 first).
      store_after(r, parent_hash, hashes) continues a chain after a block already in the
      index (KeyError "parent block 0x... is unknown" otherwise). A hash already in the index
      under a different parent, or repeated within the chain, is a ValueError.
    - match(hashes): for every replica, how many leading blocks of `hashes` it holds. A
      replica's match stops at the first block it lacks, even if it holds later ones, and is
      rounded down to a multiple of its engine block (set_engine_block(r, k), contract C2).
    - A block no replica holds is freed at once, except that it stays as an ownerless
      placeholder while a held block descends from it, so a replica that re-acquires the
      missing middle block matches through again. A placeholder is freed when its last held
      descendant goes.
    - remove_replica(r) drops r's blocks and retires the id: using it later raises
      IndexError "replica r was removed"; add_replica() reuses the lowest retired id, else
      appends one. match() reports 0 for retired ids.
    - Recency (only with `capacity` or `ttl`): each (replica, block) has a place in that
      replica's LRU order. insert, store_after and touch refresh the given blocks in reverse
      chain order (deepest first, root-most last), so the deepest block of a chain is the
      least recent and is evicted first, as engines evict. After an insert, while the replica
      holds more than `capacity` blocks its least recent block is evicted (a chain longer
      than capacity keeps its first `capacity` blocks). expire(now) drops every
      (replica, block) last touched before now - ttl. Evictions and expirations are logged
      for pop_evictions() when record_evictions is set.
    - `now` is in seconds; None reads time.monotonic(). Time never runs backwards: a `now`
      earlier than the latest one seen counts as that latest time.
    - Every method validates all of its input before changing anything: after an exception
      the index is exactly as before. Methods are safe to call from several threads.
    """

    def __init__(
        self,
        num_replicas: int = 0,
        *,
        capacity: int | None = None,
        ttl: float | None = None,
        record_evictions: bool = False,
    ) -> None:
        if isinstance(num_replicas, (bool, np.bool_)) or not _is_integer(num_replicas):
            raise TypeError(f"num_replicas must be an int, got {type(num_replicas).__name__}")
        n = operator.index(num_replicas)
        if not 0 <= n <= MAX_REPLICAS:
            raise ValueError(f"num_replicas must be in [0, {MAX_REPLICAS}], got {n}")
        if capacity is not None:
            if isinstance(capacity, (bool, np.bool_)) or not _is_integer(capacity):
                raise TypeError(f"capacity must be an int or None, got {type(capacity).__name__}")
            capacity = operator.index(capacity)
            if not 1 <= capacity < _CAPACITY_LIMIT:
                raise ValueError(f"capacity must be in [1, 2**63), got {capacity}")
        if ttl is not None:
            if isinstance(ttl, (bool, np.bool_)) or not isinstance(ttl, (int, float, np.integer, np.floating)):
                raise TypeError(f"ttl must be a number or None, got {type(ttl).__name__}")
            if not (math.isfinite(ttl) and ttl > 0):
                raise ValueError(f"ttl must be positive and finite, got {ttl!r}")
            ttl = float(ttl)
        if not isinstance(record_evictions, (bool, np.bool_)):
            raise TypeError(f"record_evictions must be a bool, got {type(record_evictions).__name__}")
        self._capacity: int | None = capacity
        self._ttl: float | None = ttl
        self._record = bool(record_evictions)
        self._tracks = capacity is not None or ttl is not None
        self._lock = threading.RLock()
        self._num = n
        self._retired: set[int] = set()
        self._blocks: dict[int, _Block] = {}
        self._count = [0] * n
        self._engine_block: dict[int, int] = {}  # C2: replica -> router blocks per engine block
        self._lru: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(n)] if self._tracks else []
        self._held_blocks = 0
        self._held_pairs = 0
        self._clock = -math.inf
        self._log: list[tuple[int, int]] = []
        self._unknown_removals = 0
        self._evictions = 0
        self._expirations = 0
        self._log_dropped = 0

    # -- replicas ---------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """Number of replica ids, retired ones included (match() returns this many counts)."""
        return self._num

    @property
    def capacity(self) -> int | None:
        """Blocks per replica before its least recent ones are evicted, or None."""
        return self._capacity

    @property
    def ttl(self) -> float | None:
        """Seconds a (replica, block) lives without being touched, or None."""
        return self._ttl

    @property
    def record_evictions(self) -> bool:
        """Whether evictions and expirations are logged for pop_evictions()."""
        return self._record

    def add_replica(self) -> int:
        """A new replica id: the lowest retired id, else num_replicas (which then grows)."""
        with self._lock:
            if self._retired:
                r = min(self._retired)
                self._retired.discard(r)
                return r
            if self._num >= MAX_REPLICAS:
                raise RuntimeError(
                    f"cannot add a replica: the index already has the maximum of {MAX_REPLICAS}"
                )
            self._num += 1
            self._count.append(0)
            if self._tracks:
                self._lru.append(OrderedDict())
            return self._num - 1

    def remove_replica(self, replica: int) -> None:
        """Drop the replica's blocks and retire its id (add_replica() may hand it out again)."""
        with self._lock:
            r = self._replica(replica)
            self._drop_all(r)
            self._retired.add(r)
            self._engine_block.pop(r, None)  # a reused id starts at 1 again

    def set_engine_block(self, replica: int, k: int) -> None:
        """The replica's engine blocks span k router blocks (contract C2): match() rounds its
        answer down to a multiple of k, since engines reuse whole engine blocks only."""
        with self._lock:
            r = self._replica(replica)
            if isinstance(k, (bool, np.bool_)) or not _is_integer(k):
                raise TypeError(f"k must be an int, got {type(k).__name__}")
            v = operator.index(k)
            if not 1 <= v <= MAX_ENGINE_BLOCK:
                raise ValueError(f"k must be in [1, {MAX_ENGINE_BLOCK}], got {v}")
            self._engine_block[r] = v

    def engine_block(self, replica: int) -> int:
        """Router blocks per engine block of the replica (1 unless set)."""
        with self._lock:
            return self._engine_block.get(self._replica(replica), 1)

    def clear_replica(self, replica: int) -> None:
        """Drop every block the replica holds (an engine's AllBlocksCleared); the id stays."""
        with self._lock:
            self._drop_all(self._replica(replica))

    def clear(self) -> None:
        """Drop every block of every replica; replica ids and counters stay."""
        with self._lock:
            self._blocks.clear()
            self._count = [0] * self._num
            for od in self._lru:
                od.clear()
            self._held_blocks = 0
            self._held_pairs = 0

    # -- blocks -----------------------------------------------------------------------------

    def insert(self, replica: int, hashes: Any, now: float | None = None) -> int:
        """The replica holds the chain `hashes` (block 0 first); returns blocks newly held."""
        with self._lock:
            r = self._replica(replica)
            hs = as_hashes(hashes).tolist()
            t = _now(now)
            self._check_chain(None, hs)
            return self._store(r, None, hs, t)

    def store_after(self, replica: int, parent_hash: int, hashes: Any, now: float | None = None) -> int:
        """The replica holds `hashes`, continuing the chain after block `parent_hash`.

        Returns blocks newly held. KeyError if the parent is not in the index (nothing changes).
        """
        with self._lock:
            r = self._replica(replica)
            parent = as_hash(parent_hash, "parent_hash")
            hs = as_hashes(hashes).tolist()
            t = _now(now)
            if parent not in self._blocks:
                raise KeyError(f"parent block 0x{parent:016x} is unknown")
            self._check_chain(parent, hs)
            return self._store(r, parent, hs, t)

    def match(self, hashes: Any) -> np.ndarray:
        """For every replica id, how many leading blocks of `hashes` it holds (int32 array)."""
        with self._lock:
            hs = as_hashes(hashes).tolist()
            out = np.zeros(self._num, dtype=np.int32)
            active = (1 << self._num) - 1
            prev = None
            depth = 0
            blocks = self._blocks
            for h in hs:
                b = blocks.get(h)
                if b is None or b.parent != prev:
                    break
                dropped = active & ~b.owners
                _assign(out, dropped, depth)
                active &= b.owners
                if not active:
                    break
                depth += 1
                prev = h
            _assign(out, active, depth)
            for r, k in self._engine_block.items():
                out[r] -= out[r] % k
            return out

    def remove(self, replica: int, hashes: Any) -> int:
        """The replica stops holding these blocks (any order); returns how many it held.

        Hashes it does not hold are ignored and counted in stats()["unknown_removals"].
        """
        with self._lock:
            r = self._replica(replica)
            hs = as_hashes(hashes).tolist()
            removed = 0
            for h in hs:
                b = self._blocks.get(h)
                if b is not None and b.owners >> r & 1:
                    if self._tracks:
                        del self._lru[r][h]
                    self._drop(r, h, b)
                    removed += 1
                else:
                    self._unknown_removals += 1
            return removed

    def touch(self, replica: int, hashes: Any, now: float | None = None) -> int:
        """Refresh the recency of the blocks the replica holds among `hashes`, deepest first.

        Returns how many of the hashes it holds (each occurrence counts).
        """
        with self._lock:
            r = self._replica(replica)
            hs = as_hashes(hashes).tolist()
            t = self._advance(_now(now))
            held = 0
            for h in reversed(hs):
                b = self._blocks.get(h)
                if b is not None and b.owners >> r & 1:
                    held += 1
                    if self._tracks:
                        od = self._lru[r]
                        od[h] = t
                        od.move_to_end(h)
            return held

    def expire(self, now: float | None = None) -> int:
        """Drop every (replica, block) last touched before now - ttl; returns how many."""
        with self._lock:
            t = self._advance(_now(now))
            if self._ttl is None:
                return 0
            limit = t - self._ttl
            dropped = 0
            for r, od in enumerate(self._lru):
                while od:
                    h, stamp = next(iter(od.items()))
                    if not stamp < limit:
                        break
                    del od[h]
                    self._drop(r, h, self._blocks[h])
                    self._log_pair(r, h)
                    dropped += 1
            self._expirations += dropped
            return dropped

    # -- queries ----------------------------------------------------------------------------

    def held(self, replica: int) -> np.ndarray:
        """The hashes the replica holds, sorted ascending (uint64 array)."""
        with self._lock:
            r = self._replica(replica)
            bit = 1 << r
            return np.array(sorted(h for h, b in self._blocks.items() if b.owners & bit), dtype=np.uint64)

    def blocks(self, replica: int) -> int:
        """Number of blocks the replica holds."""
        with self._lock:
            return self._count[self._replica(replica)]

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by at least one replica (placeholders not counted)."""
        return self._held_blocks

    def pop_evictions(self) -> tuple[np.ndarray, np.ndarray]:
        """The (replica, hash) pairs evicted for capacity or expired since the last call.

        Oldest first, as (int32 replicas, uint64 hashes); empty unless record_evictions.
        The log keeps at most EVICTION_LOG_LIMIT pairs; the rest are counted in
        stats()["evictions_dropped"].
        """
        with self._lock:
            log, self._log = self._log, []
            replicas = np.array([r for r, _ in log], dtype=np.int32)
            hashes = np.array([h for _, h in log], dtype=np.uint64)
            return replicas, hashes

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: blocks, placeholders, nodes, bytes, held pairs, per-replica blocks, ..."""
        with self._lock:
            blocks = self._blocks
            nodes = 0
            for b in blocks.values():
                p = None if b.parent is None else blocks[b.parent]
                if p is None or p.children != 1 or p.owners != b.owners:
                    nodes += 1
            size = sys.getsizeof(blocks) + len(blocks) * (sys.getsizeof(_Block(None)) + 2 * 32)
            size += sum(sys.getsizeof(od) + len(od) * 100 for od in self._lru)
            retired = self._retired
            return {
                "blocks": self._held_blocks,
                "placeholders": len(blocks) - self._held_blocks,
                "nodes": nodes,
                "bytes": size,
                "held": self._held_pairs,
                "num_replicas": self._num,
                "live_replicas": self._num - len(retired),
                "replica_blocks": list(self._count),
                "unknown_removals": self._unknown_removals,
                "evictions": self._evictions,
                "expirations": self._expirations,
                "eviction_log": len(self._log),
                "evictions_dropped": self._log_dropped,
                "capacity": self._capacity,
                "ttl": self._ttl,
            }

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken invariant; None when all hold."""
        with self._lock:
            blocks = self._blocks
            children = dict.fromkeys(blocks, 0)
            count = [0] * self._num
            held = 0
            live = (1 << self._num) - 1
            for r in self._retired:
                live &= ~(1 << r)
            for h, b in blocks.items():
                if b.parent is not None:
                    if b.parent not in blocks:
                        _broken(f"block 0x{h:016x} has a parent that is not in the index")
                    children[b.parent] += 1
                if b.owners & ~live:
                    _broken(f"block 0x{h:016x} is owned by a retired or unknown replica")
                if b.owners:
                    held += 1
                for r in range(self._num):
                    if b.owners >> r & 1:
                        count[r] += 1
            for h, b in blocks.items():
                if b.children != children[h]:
                    _broken(f"block 0x{h:016x} counts {b.children} children, has {children[h]}")
                if not b.owners and not b.children:
                    _broken(f"block 0x{h:016x} has neither owners nor children")
            if count != self._count:
                _broken("per-replica block counts disagree with the blocks")
            if held != self._held_blocks or sum(count) != self._held_pairs:
                _broken("block totals disagree with the blocks")
            if self._tracks:
                for r, od in enumerate(self._lru):
                    if len(od) != count[r] or any(not blocks[h].owners >> r & 1 for h in od):
                        _broken(f"LRU list of replica {r} disagrees with its blocks")
                    stamps = list(od.values())
                    if any(a > b for a, b in zip(stamps, stamps[1:])):
                        _broken(f"LRU list of replica {r} is not in time order")

    # -- export / import (snapshots) ------------------------------------------------------

    def export_replica(self, replica: int, now: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The replica's contents as (hashes, parents, held, ages), for snapshots.

        hashes (uint64): every block the replica holds plus the ancestors its chains hang
        from (held by others, or placeholders), in depth-first preorder from the root with
        siblings by ascending hash; parents (int64): index of each block's parent in hashes,
        -1 at the root; held (int64): indices of the blocks it holds, least recent first
        (without capacity or ttl: reverse preorder); ages (float64): seconds since each was
        last touched, relative to max(now, latest time seen) (0.0 without capacity or ttl).
        """
        with self._lock:
            r = self._replica(replica)
            t = max(_now(now), self._clock)
            order = self._preorder(1 << r)
            pos = {h: i for i, h in enumerate(order)}
            blocks = self._blocks
            parents = [-1 if blocks[h].parent is None else pos[blocks[h].parent] for h in order]
            if self._tracks:
                pairs = [(pos[h], t - stamp) for h, stamp in self._lru[r].items()]
            else:
                bit = 1 << r
                pairs = [(i, 0.0) for i in range(len(order) - 1, -1, -1) if blocks[order[i]].owners & bit]
            return (
                np.array(order, dtype=np.uint64),
                np.array(parents, dtype=np.int64),
                np.array([i for i, _ in pairs], dtype=np.int64),
                np.array([a for _, a in pairs], dtype=np.float64),
            )

    def import_replica(self, replica: int, hashes: Any, parents: Any, held: Any, ages: Any,
                       now: float | None = None) -> int:
        """Replace the replica's contents with an export_replica() result; returns blocks held.

        Blocks of `held` are refreshed in that order (least recent first), each last touched
        `age` seconds before now; beyond `capacity` the least recent are evicted (counted).
        Everything is checked first (ValueError naming the problem, index unchanged): shapes,
        parents before children, no repeated hash or held index, finite ages >= 0 that never
        increase along held, and every block's parent equal to the one the index already has
        for that hash (checked against the index before the replica's blocks are dropped).
        """
        with self._lock:
            r = self._replica(replica)
            hs, ps, hd, ag = _import_arrays(hashes, parents, held, ages)
            t = _now(now)
            self._check_contents(hs, ps, hd, ag)
            self._drop_all(r)
            self._load(r, hs, ps, hd, ag, self._advance(t))
            return self._count[r]

    def _check_contents(self, hs: list[int], ps: list[int], hd: list[int], ag: list[float]) -> None:
        """ValueError naming the first thing import_replica refuses: the shape of an export,
        or a block whose parent differs from the one the index already has."""
        with self._lock:
            _check_import(hs, ps, hd, ag)
            blocks = self._blocks
            for i, h in enumerate(hs):
                b = blocks.get(h)
                want = None if ps[i] < 0 else hs[ps[i]]
                if b is not None and b.parent != want:
                    raise ValueError(f"block 0x{h:016x} at index {i} is already in the index under a different parent")

    def _preorder(self, bit: int) -> list[int]:
        """Blocks held under `bit` and their ancestors, depth first, siblings by hash."""
        blocks = self._blocks
        need: set[int] = set()
        for h, b in blocks.items():
            if not b.owners & bit:
                continue
            x: int | None = h
            while x is not None and x not in need:
                need.add(x)
                x = blocks[x].parent
        children: dict[int | None, list[int]] = {}
        for h in need:
            children.setdefault(blocks[h].parent, []).append(h)
        stack = sorted(children.get(None, ()), reverse=True)
        out: list[int] = []
        while stack:
            h = stack.pop()
            out.append(h)
            stack.extend(sorted(children.get(h, ()), reverse=True))
        return out

    def _load(self, r: int, hs: list[int], ps: list[int], hd: list[int], ag: list[float], t: float) -> None:
        blocks = self._blocks
        for i, h in enumerate(hs):
            if h not in blocks:
                parent = None if ps[i] < 0 else hs[ps[i]]
                blocks[h] = _Block(parent)
                if parent is not None:
                    blocks[parent].children += 1
        bit = 1 << r
        for j in hd:
            b = blocks[hs[j]]
            if not b.owners:
                self._held_blocks += 1
            b.owners |= bit
        self._count[r] += len(hd)
        self._held_pairs += len(hd)
        for h in reversed(hs):  # blocks no chain needs (a hand-made export) go again
            b = blocks.get(h)
            if b is not None and not b.owners and not b.children:
                self._prune(h, b)
        if not self._tracks:
            return
        od = self._lru[r]
        for j, age in zip(hd, ag):
            od[hs[j]] = t - age
        while self._capacity is not None and self._count[r] > self._capacity:
            h, _ = od.popitem(last=False)
            self._drop(r, h, blocks[h])
            self._log_pair(r, h)
            self._evictions += 1

    def __repr__(self) -> str:
        return f"PrefixIndex(num_replicas={self._num}, blocks={self._held_blocks})"

    # -- internals --------------------------------------------------------------------------

    def _replica(self, replica: Any) -> int:
        if isinstance(replica, (bool, np.bool_)) or not _is_integer(replica):
            raise TypeError(f"replica must be an int, got {type(replica).__name__}")
        r = operator.index(replica)
        if not 0 <= r < self._num:
            raise IndexError(f"replica {r} is out of range [0, {self._num})")
        if r in self._retired:
            raise IndexError(f"replica {r} was removed")
        return r

    def _check_chain(self, parent: int | None, hs: list[int]) -> None:
        """ValueError unless hs continues the chain after parent consistently with the index."""
        prev = parent
        pending: set[int] = set()
        blocks = self._blocks
        for i, h in enumerate(hs):
            b = blocks.get(h)
            if (b is not None and b.parent != prev) or (b is None and h in pending):
                raise ValueError(
                    f"block 0x{h:016x} at index {i} is already in the index under a different parent"
                )
            if b is None:
                pending.add(h)
            prev = h

    def _advance(self, now: float) -> float:
        if now > self._clock:
            self._clock = now
        return self._clock

    def _store(self, r: int, parent: int | None, hs: list[int], now: float) -> int:
        t = self._advance(now)
        blocks = self._blocks
        bit = 1 << r
        prev = parent
        new = 0
        for h in hs:
            b = blocks.get(h)
            if b is None:
                b = blocks[h] = _Block(prev)
                if prev is not None:
                    blocks[prev].children += 1
            if not b.owners & bit:
                if not b.owners:
                    self._held_blocks += 1
                b.owners |= bit
                new += 1
            prev = h
        self._count[r] += new
        self._held_pairs += new
        if self._tracks:
            od = self._lru[r]
            for h in reversed(hs):
                od[h] = t
                od.move_to_end(h)
            cap = self._capacity
            if cap is not None:
                while self._count[r] > cap:
                    h, _ = od.popitem(last=False)
                    self._drop(r, h, blocks[h])
                    self._log_pair(r, h)
                    self._evictions += 1
        return new

    def _drop(self, r: int, h: int, b: _Block) -> None:
        """r stops holding block h (its LRU entry is already gone); free what nobody needs."""
        b.owners &= ~(1 << r)
        self._count[r] -= 1
        self._held_pairs -= 1
        if not b.owners:
            self._held_blocks -= 1
        self._prune(h, b)

    def _prune(self, h: int, b: _Block) -> None:
        blocks = self._blocks
        while not b.owners and not b.children:
            del blocks[h]
            if b.parent is None:
                return
            h = b.parent
            b = blocks[h]
            b.children -= 1

    def _drop_all(self, r: int) -> None:
        bit = 1 << r
        mine = [(h, b) for h, b in self._blocks.items() if b.owners & bit]
        for h, b in mine:
            b.owners &= ~bit
            if not b.owners:
                self._held_blocks -= 1
        self._held_pairs -= len(mine)
        self._count[r] = 0
        for h, b in mine:
            if h in self._blocks:
                self._prune(h, b)
        if self._tracks:
            self._lru[r].clear()

    def _log_pair(self, r: int, h: int) -> None:
        if not self._record:
            return
        if len(self._log) >= EVICTION_LOG_LIMIT:
            self._log_dropped += 1
        else:
            self._log.append((r, h))


def _now(now: Any) -> float:
    if now is None:
        return time.monotonic()
    if isinstance(now, (bool, np.bool_)) or not isinstance(now, (int, float, np.integer, np.floating)):
        raise TypeError(f"now must be a number or None, got {type(now).__name__}")
    value = float(now)
    if not math.isfinite(value):
        raise ValueError(f"now must be finite, got {now!r}")
    return value


def _assign(out: np.ndarray, mask: int, value: int) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = value
        mask ^= low


def _broken(what: str) -> None:
    raise RuntimeError(f"PrefixIndex invariant broken: {what}")


def _array_as_uint64(arr: np.ndarray, name: str) -> np.ndarray:
    refuse_masked(arr, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got a {arr.ndim}-D array")
    return arr.astype(np.uint64, copy=False)


def _is_integer(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _import_arrays(hashes: Any, parents: Any, held: Any, ages: Any) -> tuple[list[int], list[int], list[int], list[float]]:
    """import_replica's arrays as lists: hashes as hashes, parents and held as int64, ages
    as float64 (numpy's own conversion errors), each 1-D."""
    hs = as_hashes(hashes).tolist()
    out: list[Any] = [hs]
    for name, value, dtype in (("parents", parents, np.int64), ("held", held, np.int64), ("ages", ages, np.float64)):
        if isinstance(value, np.ndarray):
            refuse_masked(value, name)
        arr = np.asarray(value, dtype=dtype)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got a {arr.ndim}-D array")
        out.append(arr.tolist())
    return out[0], out[1], out[2], out[3]


def _check_import(hs: list[int], ps: list[int], hd: list[int], ag: list[float]) -> None:
    """ValueError naming the first thing an import cannot take (the shape of an export)."""
    n = len(hs)
    if len(ps) != n:
        raise ValueError(f"parents must have one entry per hash, got {len(ps)} for {n} hashes")
    if len(ag) != len(hd):
        raise ValueError(f"ages must have one entry per held block, got {len(ag)} for {len(hd)}")
    seen: set[int] = set()
    for i, h in enumerate(hs):
        if not -1 <= ps[i] < i:
            raise ValueError(f"parents[{i}] must be -1 or an index below {i}, got {ps[i]}")
        if h in seen:
            raise ValueError(f"hash 0x{h:016x} at index {i} is repeated")
        seen.add(h)
    taken: set[int] = set()
    for j, i in enumerate(hd):
        if not 0 <= i < n:
            raise ValueError(f"held[{j}] must be an index into hashes, got {i}")
        if i in taken:
            raise ValueError(f"held[{j}] repeats index {i}")
        taken.add(i)
        a = ag[j]
        if not (math.isfinite(a) and a >= 0):
            raise ValueError(f"ages[{j}] must be finite and >= 0")
        if j and a > ag[j - 1]:
            raise ValueError(f"ages must not increase along held (least recent first), ages[{j}] > ages[{j - 1}]")
