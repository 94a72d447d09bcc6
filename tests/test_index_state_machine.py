"""PrefixIndex, native and reference side by side, against a deliberately naive model.

The model is a dict of sets (replica -> hashes it holds) plus parent links, and per-replica
LRU order as a plain list. Existence of a block, placeholders, matches and even the radix
tree's node count are recomputed from scratch after every step. Hashes come from a small
universe of chains (paths over a 3-letter alphabet), so prefixes are shared, chains diverge,
runs split and merge; a rule also feeds chains with a foreign block spliced in.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import load_impl

NATIVE = load_impl("native")
REFERENCE = load_impl("reference")

MASK = (1 << 64) - 1


def outcome(fn, ix) -> tuple[str, Any]:
    """('ok', result) or ('raise', (exception type name, message))."""
    try:
        return "ok", fn(ix)
    except Exception as exc:  # noqa: BLE001 - the type is part of what is compared
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return "raise", (type(exc).__name__, text)


def block(path: tuple[int, ...]) -> int:
    """The hash of the block at `path`: a bijection, so distinct paths never collide, and
    spread over all 64 bits (both halves of the uint64 range occur)."""
    code = 1
    for d in path:
        code = code * 4 + d + 1
    return (code * 0x9E3779B97F4A7C15 + 0x5DEECE66D) & MASK


def chain(path: tuple[int, ...] | list[int]) -> list[int]:
    path = tuple(path)
    return [block(path[: i + 1]) for i in range(len(path))]


paths = st.lists(st.integers(0, 2), max_size=7).map(tuple)
replicas = st.integers(-1, 5)
steps = st.integers(-2, 6)  # time moves by this much; negative steps test the clamp


class Model:
    """The naive truth: who holds what, parent links, LRU lists."""

    def __init__(self, n: int, capacity: int | None, ttl: float | None, record: bool) -> None:
        self.num = n
        self.retired: set[int] = set()
        self.held: list[set[int]] = [set() for _ in range(n)]
        self.parent: dict[int, int | None] = {}
        self.lru: list[list[list[Any]]] = [[] for _ in range(n)]
        self.capacity = capacity
        self.ttl = ttl
        self.record = record
        self.tracks = capacity is not None or ttl is not None
        self.clock = -math.inf
        self.log: list[tuple[int, int]] = []
        self.unknown = 0
        self.evictions = 0
        self.expirations = 0

    def replica_error(self, r: int) -> tuple[str, str] | None:
        if not 0 <= r < self.num:
            return ("IndexError", f"replica {r} is out of range [0, {self.num})")
        if r in self.retired:
            return ("IndexError", f"replica {r} was removed")
        return None

    def existing(self) -> set[int]:
        ex: set[int] = set()
        for hs in self.held:
            for h in hs:
                while h is not None and h not in ex:
                    ex.add(h)
                    h = self.parent[h]
        return ex

    def chain_error(self, parent: int | None, hs: list[int]) -> tuple[str, str] | None:
        ex = self.existing()
        prev = parent
        seen: set[int] = set()
        for i, h in enumerate(hs):
            if (h in ex and self.parent[h] != prev) or (h not in ex and h in seen):
                return ("ValueError", f"block 0x{h:016x} at index {i} is already in the index under a different parent")
            seen.add(h)
            prev = h
        return None

    def advance(self, now: float) -> float:
        self.clock = max(self.clock, now)
        return self.clock

    def refresh(self, r: int, h: int, t: float) -> None:
        lst = self.lru[r]
        for i, (x, _) in enumerate(lst):
            if x == h:
                del lst[i]
                break
        lst.append([h, t])

    def forget(self, r: int, h: int) -> None:
        self.lru[r] = [e for e in self.lru[r] if e[0] != h]

    def drop_logged(self, r: int) -> None:
        h, _ = self.lru[r].pop(0)
        self.held[r].discard(h)
        if self.record:
            self.log.append((r, h))

    def store(self, r: int, parent: int | None, hs: list[int], now: float) -> int:
        t = self.advance(now)
        prev = parent
        new = 0
        for h in hs:
            self.parent[h] = prev
            if h not in self.held[r]:
                self.held[r].add(h)
                new += 1
            prev = h
        if self.tracks:
            for h in reversed(hs):
                self.refresh(r, h, t)
            if self.capacity is not None:
                while len(self.held[r]) > self.capacity:
                    self.drop_logged(r)
                    self.evictions += 1
        return new

    def remove(self, r: int, hs: list[int]) -> int:
        n = 0
        for h in hs:
            if h in self.held[r]:
                self.held[r].discard(h)
                if self.tracks:
                    self.forget(r, h)
                n += 1
            else:
                self.unknown += 1
        return n

    def touch(self, r: int, hs: list[int], now: float) -> int:
        t = self.advance(now)
        n = 0
        for h in reversed(hs):
            if h in self.held[r]:
                n += 1
                if self.tracks:
                    self.refresh(r, h, t)
        return n

    def expire(self, now: float) -> int:
        t = self.advance(now)
        if self.ttl is None:
            return 0
        n = 0
        for r in range(self.num):
            while self.lru[r] and self.lru[r][0][1] < t - self.ttl:
                self.drop_logged(r)
                n += 1
        self.expirations += n
        return n

    def match(self, hs: list[int]) -> list[int]:
        out = []
        for r in range(self.num):
            k = 0
            prev = None
            for h in hs:
                if h not in self.held[r] or self.parent[h] != prev:
                    break
                k += 1
                prev = h
            out.append(k)
        return out

    def nodes(self) -> int:
        ex = self.existing()
        children = Counter(self.parent[h] for h in ex if self.parent[h] is not None)

        def owners(h: int) -> frozenset[int]:
            return frozenset(r for r in range(self.num) if h in self.held[r])

        return sum(
            1
            for h in ex
            if self.parent[h] is None or children[self.parent[h]] != 1 or owners(self.parent[h]) != owners(h)
        )


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        n=st.integers(0, 4),
        capacity=st.sampled_from([None, None, 1, 2, 3, 5, 8]),
        ttl=st.sampled_from([None, None, 4.0, 10]),
        record=st.booleans(),
    )
    def setup(self, n: int, capacity: int | None, ttl: float | None, record: bool) -> None:
        kw = dict(capacity=capacity, ttl=ttl, record_evictions=record)
        self.pair = (NATIVE.PrefixIndex(n, **kw), REFERENCE.PrefixIndex(n, **kw))
        self.model = Model(n, capacity, ttl, record)
        self.t = 0.0
        self.recent: list[list[int]] = []

    # -- helpers ----------------------------------------------------------------------------

    def both(self, fn) -> tuple[str, Any]:
        got = [outcome(fn, ix) for ix in self.pair]
        assert got[0] == got[1], f"native {got[0]!r} != reference {got[1]!r}"
        return got[0]

    def expect(self, got: tuple[str, Any], error: tuple[str, str] | None, result: Any = None) -> None:
        if error is not None:
            assert got == ("raise", error), f"expected {error!r}, got {got!r}"
        else:
            assert got == ("ok", result), f"expected {result!r}, got {got!r}"

    def now(self, dt: int) -> float:
        self.t += dt
        return self.t

    def remember(self, hs: list[int]) -> None:
        if hs:
            self.recent = (self.recent + [hs])[-6:]

    # -- rules ------------------------------------------------------------------------------

    @rule()
    def add_replica(self) -> None:
        m = self.model
        if m.retired:
            r = min(m.retired)
            m.retired.discard(r)
        else:
            r = m.num
            m.num += 1
            m.held.append(set())
            m.lru.append([])
        self.expect(self.both(lambda ix: ix.add_replica()), None, r)

    @rule(r=replicas)
    def remove_replica(self, r: int) -> None:
        m = self.model
        err = m.replica_error(r)
        got = self.both(lambda ix: ix.remove_replica(r))
        if err is None:
            m.held[r] = set()
            m.lru[r] = []
            m.retired.add(r)
        self.expect(got, err)

    @rule(r=replicas)
    def clear_replica(self, r: int) -> None:
        m = self.model
        err = m.replica_error(r)
        got = self.both(lambda ix: ix.clear_replica(r))
        if err is None:
            m.held[r] = set()
            m.lru[r] = []
        self.expect(got, err)

    @precondition(lambda self: self.model.num > 0)
    @rule()
    def clear(self) -> None:
        m = self.model
        m.held = [set() for _ in range(m.num)]
        m.lru = [[] for _ in range(m.num)]
        self.expect(self.both(lambda ix: ix.clear()), None)

    @rule(r=replicas, path=paths, dt=steps)
    def insert(self, r: int, path: tuple[int, ...], dt: int) -> None:
        self._store(r, None, chain(path), self.now(dt))

    @rule(r=replicas, path=paths, other=paths, pos=st.integers(0, 6), dt=steps)
    def insert_spliced(self, r: int, path: tuple[int, ...], other: tuple[int, ...], pos: int, dt: int) -> None:
        """A chain with a block from elsewhere in it: valid only if that block is unknown."""
        hs = chain(path)
        if other and hs:
            hs[pos % len(hs)] = block(other)
        self._store(r, None, hs, self.now(dt))

    @rule(r=replicas, path=paths, more=paths, dt=steps)
    def store_after(self, r: int, path: tuple[int, ...], more: tuple[int, ...], dt: int) -> None:
        if not path:
            return
        parent = block(path)
        hs = chain(path + more)[len(path) :]
        self._store(r, parent, hs, self.now(dt))

    def _store(self, r: int, parent: int | None, hs: list[int], now: float) -> None:
        m = self.model
        err = m.replica_error(r)
        if err is None and parent is not None and parent not in m.existing():
            err = ("KeyError", f"parent block 0x{parent:016x} is unknown")
        if err is None:
            err = m.chain_error(parent, hs)
        if parent is None:
            got = self.both(lambda ix: ix.insert(r, hs, now=now))
        else:
            got = self.both(lambda ix: ix.store_after(r, parent, hs, now=now))
        result = m.store(r, parent, hs, now) if err is None else None
        self.expect(got, err, result)
        self.remember(hs)

    @rule(r=replicas, picks=st.lists(paths, max_size=6), whole=paths)
    def remove(self, r: int, picks: list[tuple[int, ...]], whole: tuple[int, ...]) -> None:
        hs = [block(p) for p in picks if p] + chain(whole)[::-1]
        m = self.model
        err = m.replica_error(r)
        got = self.both(lambda ix: ix.remove(r, hs))
        self.expect(got, err, None if err else m.remove(r, hs))

    @rule(r=replicas, picks=st.lists(paths, max_size=6), dt=steps)
    def touch(self, r: int, picks: list[tuple[int, ...]], dt: int) -> None:
        hs = [block(p) for p in picks if p]
        now = self.now(dt)
        m = self.model
        err = m.replica_error(r)
        got = self.both(lambda ix: ix.touch(r, hs, now=now))
        self.expect(got, err, None if err else m.touch(r, hs, now))

    @rule(dt=steps)
    def expire(self, dt: int) -> None:
        now = self.now(dt)
        got = self.both(lambda ix: ix.expire(now=now))
        self.expect(got, None, self.model.expire(now))

    @rule(path=paths)
    def match(self, path: tuple[int, ...]) -> None:
        hs = chain(path)
        got = self.both(lambda ix: ix.match(hs).tolist())
        self.expect(got, None, self.model.match(hs))

    @rule()
    def pop_evictions(self) -> None:
        got = self.both(lambda ix: [a.tolist() for a in ix.pop_evictions()])
        log, self.model.log = self.model.log, []
        self.expect(got, None, [[r for r, _ in log], [h for _, h in log]])

    # -- after every step -------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "model"):
            return
        for ix in self.pair:
            ix.check_invariants()
        m = self.model
        stats = [ix.stats() for ix in self.pair]
        for s in stats:
            s.pop("bytes")
        assert stats[0] == stats[1]
        s = stats[0]
        union = set().union(*m.held) if m.held else set()
        expected = {
            "blocks": len(union),
            "placeholders": len(m.existing()) - len(union),
            "nodes": m.nodes(),
            "held": sum(len(h) for h in m.held),
            "num_replicas": m.num,
            "live_replicas": m.num - len(m.retired),
            "replica_blocks": [len(h) for h in m.held],
            "unknown_removals": m.unknown,
            "evictions": m.evictions,
            "expirations": m.expirations,
            "eviction_log": len(m.log),
            "evictions_dropped": 0,
            "capacity": m.capacity,
            "ttl": None if m.ttl is None else float(m.ttl),
        }
        assert s == expected
        for ix in self.pair:
            assert ix.num_replicas == m.num
            assert ix.num_blocks == len(union)
            for r in range(m.num):
                if r not in m.retired:
                    assert ix.held(r).tolist() == sorted(m.held[r])
                    assert ix.blocks(r) == len(m.held[r])
            for hs in self.recent:
                assert ix.match(hs).tolist() == m.match(hs)


TestIndexMachine = IndexMachine.TestCase
