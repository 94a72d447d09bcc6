"""Router, reference twin of cpp/src/router.cpp: affinity versus load, sessions, lifecycle.

API (the contract the simulator and gateways code against):

    Router(config: RouterConfig | None = None, replicas: Iterable[str] = ())
    .add_replica(name) -> int; .remove_replica(name); .drain(name, draining=True)
    .set_healthy(name, healthy); .replicas -> list[str]; .replica_id(name) -> int
    .route(tokens, *, session=None, now=None) -> Decision
    .route_hashes(hashes, num_tokens, *, session=None, now=None) -> Decision
    .prefill_done(handle, now=None); .finish(handle, now=None)
    .report_load(name, *, waiting=None, running=None, kv_usage=None); .load(name) -> dict
    .index -> PrefixIndex; .speculative_index -> PrefixIndex | None (hybrid); .stats() -> dict

Decisions, in order: validate every argument; if no replica is live, healthy and not
draining, RuntimeError. Expire the index(es) when they have a TTL (time-driven
housekeeping). Match the prompt's block hashes against the index (hybrid: elementwise max
with the speculative index; ttft: then raised, per eligible replica, to the longest common
leading-block run with any request on it before its first token, the pending cache). A
session bound to a replica that is still eligible and not saturated keeps it; otherwise
the policy chooses (over the eligible replicas, without the saturated bound one if any
other is eligible). In approximate mode the prompt is then
inserted under the chosen replica (hybrid: into the speculative index); only after that
insert succeeded does anything else change: the rotation offset and random generator
advance, the request is reserved on the replica (route-and-reserve), the session table
is updated (sliding TTL, LRU beyond max_sessions).

Lifecycle: route() returns a Decision with a handle (1, 2, ...). prefill_done(handle) at
the first token moves the request from prefill to decode; finish(handle) releases it.
A handle never issued is an IndexError; one already finished, or prefill_done twice, a
RuntimeError. remove_replica() releases the accounting of the requests in flight on it;
their handles stay valid until finished, and prefill_done/finish on them are no-ops.

Stranded blocks: a rebound session reports the block count of its last prompt on its
previous replica (the KV work it leaves behind), even when that replica was removed.

Randomness (random, power_of_two, dynamo with temperature) comes from a splitmix64
generator seeded with config.seed, identical in both implementations, so the same calls
give the same decisions. Replica names and sessions are placed on the sticky ring by
FNV-1a-64 of their UTF-8 bytes, mixed by the splitmix64 finalizer.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .args import check_text
from .hashing import block_hashes, tokens_as_uint32
from .index import PrefixIndex, _now, as_hashes

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    """The splitmix64 finalizer: a bijective 64-bit mix."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64-bit: places names and sessions on the sticky ring."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & _M64
    return h


class SplitMix64:
    """The deterministic generator both implementations share."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        """The next 64-bit output."""
        self.state = (self.state + _GOLDEN) & _M64
        return mix64(self.state)

    def unit(self) -> float:
        """A float in [0, 1) from the top 53 bits of the next output."""
        return (self.next() >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why; `handle` is for prefill_done() and finish().

    replica/replica_id: the chosen replica. matched_blocks: leading blocks of the prompt
    it holds (ttft: or will hold once the requests queued there before it prefill);
    cached_tokens: min(matched_blocks * block_size, prompt_tokens).
    reason: "session", "affinity", "load", "miss", "balance", "hash" or "overflow" (see
    kvroute.config). binding: "none" (no session), "new", "kept" or "rebound".
    stranded_blocks: on a rebind, the session's blocks left on its previous replica.
    """

    replica: str
    replica_id: int
    matched_blocks: int
    cached_tokens: int
    prompt_tokens: int
    reason: str
    binding: str
    stranded_blocks: int
    handle: int

    def __repr__(self) -> str:
        return (
            f"Decision(replica='{self.replica}', replica_id={self.replica_id}, "
            f"matched_blocks={self.matched_blocks}, cached_tokens={self.cached_tokens}, "
            f"prompt_tokens={self.prompt_tokens}, reason='{self.reason}', "
            f"binding='{self.binding}', stranded_blocks={self.stranded_blocks}, "
            f"handle={self.handle})"
        )


class _Request:
    __slots__ = ("replica", "uncached", "blocks", "uncached_blocks", "prefilled")

    def __init__(self, replica: int, uncached: int, blocks: int, uncached_blocks: int) -> None:
        self.replica = replica  # -1 once its replica was removed
        self.uncached = uncached
        self.blocks = blocks
        self.uncached_blocks = uncached_blocks
        self.prefilled = False


class _Session:
    __slots__ = ("replica", "gen", "blocks", "last_seen")

    def __init__(self, replica: int, gen: int, blocks: int, last_seen: float) -> None:
        self.replica = replica
        self.gen = gen
        self.blocks = blocks
        self.last_seen = last_seen


def _config(config: Any) -> Any:
    from ..config import RouterConfig

    if config is None:
        return RouterConfig()
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a RouterConfig or None, got {type(config).__name__}")
    return config


def _name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"replica name must be a str, got {type(name).__name__}")
    return check_text(name, "replica name")


def _flag(what: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__}")
    return bool(value)


def _count(what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if not 0 <= v < (1 << 63):
        raise ValueError(f"{what} must be in [0, 2**63), got {v}")
    return v


class Router:
    """Chooses a replica per request by KV-cache affinity versus load; see the module doc."""

    def __init__(self, config: Any = None, replicas: Iterable[str] = ()) -> None:
        cfg = _config(config)
        self._cfg = cfg
        self._policy = cfg.policy
        self._p = dict(cfg.params)
        self._bs = cfg.block_size
        self._salt = cfg.salt_bytes()
        self._lock = threading.RLock()
        self._index = PrefixIndex(0, capacity=cfg.index_capacity, ttl=cfg.index_ttl)
        self._spec = (
            PrefixIndex(0, capacity=cfg.index_capacity, ttl=cfg.speculative_ttl)
            if cfg.mode == "hybrid"
            else None
        )
        self._names: list[str | None] = []
        self._ids: dict[str, int] = {}
        self._gen: list[int] = []
        self._healthy: list[bool] = []
        self._draining: list[bool] = []
        self._queued: list[int] = []
        self._inflight: list[int] = []
        self._prefill_reqs: list[int] = []
        self._prefill_blocks: list[int] = []
        self._decode_blocks: list[int] = []
        self._waiting: list[int | None] = []
        self._running: list[int | None] = []
        self._kv: list[float | None] = []
        self._requests: dict[int, _Request] = {}
        # ttft: per replica, handle -> prompt hashes of its requests before their first token.
        self._pending: list[dict[int, list[int]]] = []
        self._next_handle = 1
        self._rot = 0
        self._rng = SplitMix64(cfg.seed)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._ring: list[tuple[int, int]] = []
        self._ring_keys: list[int] = []
        self._stats = {
            "routed": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "rebinds": 0,
            "stranded_blocks": 0,
            "session_expirations": 0,
            "session_evictions": 0,
        }
        if isinstance(replicas, (str, bytes)):
            raise TypeError("replicas must be an iterable of names, got a single str")
        for name in replicas:
            self.add_replica(name)

    # -- replicas ---------------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The RouterConfig this router was built with."""
        return self._cfg

    @property
    def index(self) -> PrefixIndex:
        """The prefix index routing reads (and, in approximate mode, writes); events feed it."""
        return self._index

    @property
    def speculative_index(self) -> PrefixIndex | None:
        """Hybrid mode's short-TTL index of route-time insertions, else None."""
        return self._spec

    @property
    def replicas(self) -> list[str]:
        """Names of the replicas, in id order (removed ones left out)."""
        with self._lock:
            return [n for n in self._names if n is not None]

    def replica_id(self, name: str) -> int:
        """The dense id of a replica (its id in router.index)."""
        with self._lock:
            return self._lookup(name)

    def add_replica(self, name: str) -> int:
        """Add a replica (healthy, not draining); returns its id (the lowest free one)."""
        with self._lock:
            _name(name)
            if not name:
                raise ValueError("replica name must not be empty")
            if name in self._ids:
                raise ValueError(f"replica '{name}' already exists")
            r = self._index.add_replica()
            if self._spec is not None:
                self._spec.add_replica()
            # Ids added to router.index directly (not through the Router) stay dead slots here.
            while r >= len(self._names):
                for arr, v in self._arrays():
                    arr.append(v)
                self._gen.append(0)
                self._pending.append({})
            for arr, v in self._arrays():
                arr[r] = v
            self._names[r] = name
            self._gen[r] += 1
            self._ids[name] = r
            self._rebuild_ring()
            return r

    def remove_replica(self, name: str) -> None:
        """Remove a replica: its index blocks go, its in-flight requests are released."""
        with self._lock:
            r = self._lookup(name)
            self._index.remove_replica(r)
            if self._spec is not None:
                self._spec.remove_replica(r)
            for h, req in self._requests.items():
                if req.replica == r:
                    self._release_pending(h, req)
                    req.replica = -1
            for arr, v in self._arrays():
                arr[r] = v
            self._names[r] = None
            del self._ids[name]
            self._rebuild_ring()

    def drain(self, name: str, draining: bool = True) -> None:
        """Stop (or resume) sending new requests to a replica; its state is kept."""
        with self._lock:
            r = self._lookup(name)
            self._draining[r] = _flag("draining", draining)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Mark a replica healthy or not; an unhealthy replica is never chosen."""
        with self._lock:
            r = self._lookup(name)
            self._healthy[r] = _flag("healthy", healthy)

    def report_load(
        self,
        name: str,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Set engine-reported load figures (those given; None leaves a figure as it is)."""
        with self._lock:
            r = self._lookup(name)
            w = None if waiting is None else _count("waiting", waiting)
            n = None if running is None else _count("running", running)
            k = None
            if kv_usage is not None:
                if isinstance(kv_usage, (bool, np.bool_)) or not isinstance(
                    kv_usage, (int, float, np.integer, np.floating)
                ):
                    raise TypeError(f"kv_usage must be a float, got {type(kv_usage).__name__}")
                k = float(kv_usage)
                if not 0.0 <= k <= 1.0:
                    raise ValueError(f"kv_usage must be in [0, 1], got {k!r}")
            if w is not None:
                self._waiting[r] = w
            if n is not None:
                self._running[r] = n
            if k is not None:
                self._kv[r] = k

    def load(self, name: str) -> dict[str, Any]:
        """A replica's load terms: the router's own accounting plus reported figures."""
        with self._lock:
            r = self._lookup(name)
            return {
                "queued_prefill_tokens": self._queued[r],
                "in_flight": self._inflight[r],
                "prefill_requests": self._prefill_reqs[r],
                "active_blocks": self._prefill_blocks[r] + self._decode_blocks[r],
                "prefill_blocks": self._prefill_blocks[r],
                "decode_blocks": self._decode_blocks[r],
                "waiting": self._waiting[r],
                "running": self._running[r],
                "kv_usage": self._kv[r],
                "healthy": self._healthy[r],
                "draining": self._draining[r],
            }

    def stats(self) -> dict[str, Any]:
        """Counters: decisions, tokens, rebinds, sessions, requests in flight."""
        with self._lock:
            out = dict(self._stats)
            out["sessions"] = len(self._sessions)
            out["in_flight"] = len(self._requests)
            out["replicas"] = len(self._ids)
            return out

    # -- routing ----------------------------------------------------------------------------

    def route(self, tokens: Any, *, session: str | None = None, now: float | None = None) -> Decision:
        """Route a prompt of token ids (hashed with config.block_size and config.salt)."""
        data = tokens_as_uint32(tokens)
        hashes = block_hashes(data, self._bs, salt=self._salt)
        return self._route(hashes, len(data), session, now)

    def route_hashes(
        self, hashes: Any, num_tokens: int, *, session: str | None = None, now: float | None = None
    ) -> Decision:
        """Route a prompt given as precomputed block hashes covering num_tokens tokens."""
        hs = as_hashes(hashes)
        n = _count("num_tokens", num_tokens)
        return self._route(hs, n, session, now)

    def prefill_done(self, handle: int, now: float | None = None) -> None:
        """The request produced its first token: its prompt moves from prefill to decode."""
        with self._lock:
            h = self._handle(handle)
            _now(now)
            req = self._request(h)
            if req.replica < 0:
                return
            if req.prefilled:
                raise RuntimeError(f"request {h} already reported its first token")
            r = req.replica
            req.prefilled = True
            self._release_pending(h, req)
            self._queued[r] -= req.uncached
            self._prefill_reqs[r] -= 1
            self._prefill_blocks[r] -= req.uncached_blocks
            self._decode_blocks[r] += req.blocks

    def finish(self, handle: int, now: float | None = None) -> None:
        """The request ended (completed, failed or cancelled): release its load."""
        with self._lock:
            h = self._handle(handle)
            _now(now)
            req = self._request(h)
            del self._requests[h]
            r = req.replica
            if r < 0:
                return
            if req.prefilled:
                self._decode_blocks[r] -= req.blocks
            else:
                self._release_pending(h, req)
                self._queued[r] -= req.uncached
                self._prefill_reqs[r] -= 1
                self._prefill_blocks[r] -= req.uncached_blocks
            self._inflight[r] -= 1

    # -- internals --------------------------------------------------------------------------

    def _release_pending(self, h: int, req: _Request) -> None:
        self._pending[req.replica].pop(h, None)

    def _arrays(self) -> list[tuple[list[Any], Any]]:
        return [
            (self._names, None),
            (self._healthy, True),
            (self._draining, False),
            (self._queued, 0),
            (self._inflight, 0),
            (self._prefill_reqs, 0),
            (self._prefill_blocks, 0),
            (self._decode_blocks, 0),
            (self._waiting, None),
            (self._running, None),
            (self._kv, None),
        ]

    def _lookup(self, name: Any) -> int:
        _name(name)
        r = self._ids.get(name)
        if r is None:
            raise KeyError(f"unknown replica '{name}'")
        return r

    def _handle(self, handle: Any) -> int:
        if isinstance(handle, (bool, np.bool_)):
            raise TypeError(f"handle must be an int, got {type(handle).__name__}")
        try:
            return operator.index(handle)
        except TypeError:
            raise TypeError(f"handle must be an int, got {type(handle).__name__}") from None

    def _request(self, h: int) -> _Request:
        req = self._requests.get(h)
        if req is None:
            if 1 <= h < self._next_handle:
                raise RuntimeError(f"request {h} already finished")
            raise IndexError(f"unknown handle {h}")
        return req

    def _rebuild_ring(self) -> None:
        vnodes = self._p.get("vnodes")
        if vnodes is None:
            return
        ring = []
        for r, name in enumerate(self._names):
            if name is None:
                continue
            base = fnv1a64(name.encode("utf-8"))
            for k in range(vnodes):
                ring.append((mix64((base + k * _GOLDEN) & _M64), r))
        ring.sort()
        self._ring = ring
        self._ring_keys = [pos for pos, _ in ring]

    def _route(self, hashes: np.ndarray, num_tokens: int, session: Any, now: Any) -> Decision:
        if session is not None and not isinstance(session, str):
            raise TypeError(f"session must be a str or None, got {type(session).__name__}")
        if session is not None:
            check_text(session, "session")
        t = time.monotonic() if now is None else _now(now)
        with self._lock:
            eligible = [
                r
                for r, name in enumerate(self._names)
                if name is not None and self._healthy[r] and not self._draining[r]
            ]
            if not eligible:
                raise RuntimeError("no eligible replica: every replica is removed, drained or unhealthy")
            cfg = self._cfg
            if cfg.index_ttl is not None:
                self._index.expire(t)
            if self._spec is not None:
                self._spec.expire(t)
            hl = hashes.tolist()
            match = self._index.match(hashes).tolist()
            if self._spec is not None:
                match = [max(a, b) for a, b in zip(match, self._spec.match(hashes).tolist())]
            if self._policy == "ttft":
                # A prompt queued behind a request with the same leading blocks on the same
                # FIFO replica finds them cached when its own prefill starts: count them.
                p = len(hl)
                for r in eligible:
                    m = match[r]
                    for other in self._pending[r].values():
                        n = min(len(other), p)
                        if n <= m:
                            continue
                        k = 0
                        while k < n and other[k] == hl[k]:
                            k += 1
                        m = max(m, k)
                    match[r] = m
            ctx = _Ctx(self, hl, num_tokens, match, session, eligible)

            # Session: keep the bound replica unless it is gone or saturated.
            entry = self._sessions.get(session) if session is not None else None
            if entry is not None and entry.last_seen + cfg.session_ttl <= t:
                expired_entry = True
                entry = None
            else:
                expired_entry = False
            binding = "none" if session is None else "new"
            stranded = 0
            chosen = -1
            reason = ""
            if entry is not None:
                b = entry.replica
                valid = self._names[b] is not None and self._gen[b] == entry.gen and b in eligible
                if valid and not ctx.saturated(b, eligible):
                    chosen, reason = b, "session"
                else:
                    cands = eligible
                    if valid and len(eligible) > 1:
                        cands = [r for r in eligible if r != b]
                    chosen, reason = ctx.choose(cands)
                if valid and chosen == b:
                    binding = "kept"
                else:
                    binding = "rebound"
                    stranded = entry.blocks
            else:
                chosen, reason = ctx.choose(eligible)

            # The one step that may still fail (a chain that contradicts the index) comes first.
            if cfg.mode == "approximate":
                self._index.insert(chosen, hashes, t)
            elif self._spec is not None:
                self._spec.insert(chosen, hashes, t)

            self._rot += 1
            self._rng.state = ctx.rng.state
            p = len(hl)
            matched = match[chosen]
            cached = min(matched * self._bs, num_tokens)
            uncached_blocks = p - matched
            h = self._next_handle
            self._next_handle += 1
            if self._policy == "ttft":
                self._pending[chosen][h] = hl
            self._requests[h] = _Request(chosen, num_tokens - cached, p, uncached_blocks)
            self._queued[chosen] += num_tokens - cached
            self._inflight[chosen] += 1
            self._prefill_reqs[chosen] += 1
            self._prefill_blocks[chosen] += uncached_blocks
            st = self._stats
            st["routed"] += 1
            st["prompt_tokens"] += num_tokens
            st["cached_tokens"] += cached
            if binding == "rebound":
                st["rebinds"] += 1
                st["stranded_blocks"] += stranded
            if session is not None:
                sessions = self._sessions
                if expired_entry:
                    del sessions[session]
                    st["session_expirations"] += 1
                while sessions:
                    head = next(iter(sessions.values()))
                    if head.last_seen + cfg.session_ttl > t:
                        break
                    sessions.popitem(last=False)
                    st["session_expirations"] += 1
                cur = sessions.get(session)
                if cur is None:
                    sessions[session] = _Session(chosen, self._gen[chosen], p, t)
                else:
                    cur.replica, cur.gen, cur.blocks, cur.last_seen = chosen, self._gen[chosen], p, t
                    sessions.move_to_end(session)
                while len(sessions) > cfg.max_sessions:
                    sessions.popitem(last=False)
                    st["session_evictions"] += 1
            return Decision(
                self._names[chosen],  # type: ignore[arg-type]
                chosen,
                matched,
                cached,
                num_tokens,
                reason,
                binding,
                stranded,
                h,
            )


class _Ctx:
    """One decision's inputs: the prompt, its matches, the router's load vectors."""

    def __init__(
        self, router: Router, hashes: list[int], num_tokens: int, match: list[int], session: Any, eligible: list[int]
    ) -> None:
        self.rt = router
        self.eligible = eligible
        self.hashes = hashes
        self.n = num_tokens
        self.match = match
        self.session = session
        self.p = router._p
        self.bs = router._bs
        self.rng = SplitMix64(router._rng.state)

    def mtok(self, r: int) -> int:
        return min(self.match[r] * self.bs, self.n)

    def rotated(self, cands: list[int]) -> list[int]:
        """Candidates starting at the rotation offset: ties go to the earliest here."""
        k = self.rt._rot % len(cands)
        return cands[k:] + cands[:k]

    @staticmethod
    def argmin(order: list[int], key: Any) -> int:
        best = order[0]
        best_key = key(best)
        for r in order[1:]:
            k = key(r)
            if k < best_key:
                best, best_key = r, k
        return best

    def generic_reason(self, order: list[int], chosen: int) -> str:
        top = max(self.match[r] for r in order)
        if top == 0:
            return "miss"
        return "affinity" if self.match[chosen] == top else "load"

    # Saturation of a session's bound replica, as each policy defines it.
    def saturated(self, b: int, eligible: list[int]) -> bool:
        rt, pol, p = self.rt, self.rt._policy, self.p
        if pol == "sglang":
            lo = min(rt._inflight[r] for r in eligible)
            load = rt._inflight[b]
            return load - lo > p["balance_abs_threshold"] and load > lo * p["balance_rel_threshold"]
        if pol == "linear":
            mean = sum(rt._queued[r] for r in eligible) / len(eligible)
            return rt._queued[b] > p["escape_factor"] * mean
        if pol == "sticky":
            if p["bound"] is None:
                return False
            return rt._inflight[b] >= self.capacity(eligible)
        mean = sum(rt._inflight[r] for r in eligible) / len(eligible)
        return rt._inflight[b] > max(1.0, rt._cfg.session_saturation * mean)

    def capacity(self, cands: list[int]) -> int:
        total = sum(self.rt._inflight[r] for r in cands)
        return math.ceil(self.p["bound"] * (total + 1) / len(cands))

    def choose(self, cands: list[int]) -> tuple[int, str]:
        rt, p = self.rt, self.p
        order = self.rotated(cands)
        pol = rt._policy
        inflight, queued = rt._inflight, rt._queued
        if pol == "round_robin":
            return order[0], "balance"
        if pol == "random":
            return order[self.rng.next() % len(order)], "balance"
        if pol == "least_loaded":
            return self.argmin(order, lambda r: inflight[r]), "balance"
        if pol == "power_of_two":
            n = len(order)
            if n == 1:
                return order[0], "balance"
            i = self.rng.next() % n
            j = self.rng.next() % (n - 1)
            if j >= i:
                j += 1
            a, b = order[i], order[j]
            return (b if inflight[b] < inflight[a] else a), "balance"
        if pol == "sticky":
            return self.sticky(order)
        if pol == "linear":
            return self.linear(order)
        if pol == "sglang":
            lo = min(inflight[r] for r in order)
            hi = max(inflight[r] for r in order)
            if hi - lo > p["balance_abs_threshold"] and hi > lo * p["balance_rel_threshold"]:
                return self.argmin(order, lambda r: inflight[r]), "load"
            top = max(self.match[r] for r in order)
            rate = min(top * self.bs, self.n) / self.n if self.n > 0 else 0.0
            if rate > p["cache_threshold"]:
                return next(r for r in order if self.match[r] == top), "affinity"
            return self.argmin(order, lambda r: inflight[r]), "miss"
        if pol == "dynamo":
            return self.dynamo(order)
        if pol == "llmd":
            return self.llmd(order)
        if pol == "preble":
            dw = p["decode_weight"]

            def cost(r: int) -> float:
                return float(queued[r] + self.n - self.mtok(r)) + dw * inflight[r]

            top = max(self.match[r] for r in order)
            mt = min(top * self.bs, self.n)
            pool = [r for r in order if self.match[r] == top] if mt > self.n - mt else order
            chosen = self.argmin(pool, cost)
            return chosen, self.generic_reason(order, chosen)
        # ttft, compared in tokens (one prefill_rate divides all): this request's wait and
        # prefill, plus the prefill it adds to the fleet beyond the best-cached candidate.
        best = min(self.n - self.mtok(r) for r in order)
        chosen = self.argmin(
            order,
            lambda r: (queued[r] + 2 * (self.n - self.mtok(r)) - best, -self.match[r], inflight[r]),
        )
        return chosen, self.generic_reason(order, chosen)

    def sticky(self, order: list[int]) -> tuple[int, str]:
        rt, p = self.rt, self.p
        if self.session is not None:
            key = mix64(fnv1a64(self.session.encode("utf-8")))
        elif self.hashes:
            key = mix64(self.hashes[0])
        else:
            return order[0], "balance"
        allowed = set(order)
        # Capacity over every eligible replica, also when a saturated bound one is excluded.
        cap = self.capacity(self.eligible) if p["bound"] is not None else None
        ring = rt._ring
        start = _lower_bound(rt._ring_keys, key)
        first = True
        for i in range(len(ring)):
            r = ring[(start + i) % len(ring)][1]
            if r not in allowed:
                continue
            if cap is None or rt._inflight[r] < cap:
                return r, "hash" if first else "overflow"
            first = False
        raise AssertionError("bounded loads: some replica is always below capacity")

    def linear(self, order: list[int]) -> tuple[int, str]:
        p, queued = self.p, self.rt._queued
        wa, wl, mm = p["w_affinity"], p["w_load"], p["min_match_tokens"]

        def aff(r: int) -> int:
            m = self.mtok(r)
            return m if m >= mm else 0

        top_aff = max(aff(r) for r in order)
        if top_aff == 0:
            return self.argmin(order, lambda r: -(wa * 0 - wl * queued[r])), "miss"
        best_aff = next(r for r in order if aff(r) == top_aff)
        mean = sum(queued[r] for r in order) / len(order)
        if queued[best_aff] > p["escape_factor"] * mean:
            return self.argmin(order, lambda r: queued[r]), "load"
        chosen = self.argmin(order, lambda r: -(wa * aff(r) - wl * queued[r]))
        return chosen, "affinity" if aff(chosen) == top_aff else "load"

    def dynamo(self, order: list[int]) -> tuple[int, str]:
        rt, p = self.rt, self.p
        pb = len(self.hashes)
        scale, temp = p["prefill_load_scale"], p["temperature"]
        costs = [
            scale * max(rt._prefill_blocks[r] + pb - self.match[r], 0) + float(rt._decode_blocks[r] + pb)
            for r in order
        ]
        if temp > 0.0:
            lo, hi = min(costs), max(costs)
            span = hi - lo
            weights = [math.exp(-((c - lo) / span if span > 0.0 else 0.0) / temp) for c in costs]
            total = 0.0
            for w in weights:
                total += w
            u = self.rng.unit() * total
            acc = 0.0
            chosen = order[-1]
            for r, w in zip(order, weights):
                acc += w
                if u < acc:
                    chosen = r
                    break
        else:
            best = 0
            for i in range(1, len(order)):
                if costs[i] < costs[best]:
                    best = i
            chosen = order[best]
        return chosen, self.generic_reason(order, chosen)

    def llmd(self, order: list[int]) -> tuple[int, str]:
        rt, p = self.rt, self.p
        pb = len(self.hashes)
        q: dict[int, int] = {}
        for r in order:
            waiting = rt._waiting[r]
            q[r] = waiting if waiting is not None else rt._prefill_reqs[r]
        qmax, qmin = max(q.values()), min(q.values())

        def score(r: int) -> float:
            prefix = self.match[r] / pb if pb > 0 else 0.0
            queue = (qmax - q[r]) / (qmax - qmin) if qmax > qmin else 1.0
            usage = rt._kv[r]
            kv = 1.0 - (usage if usage is not None else 0.0)
            return p["w_prefix"] * prefix + p["w_queue"] * queue + p["w_kv"] * kv

        chosen = self.argmin(order, lambda r: -score(r))
        return chosen, self.generic_reason(order, chosen)


def _lower_bound(keys: list[int], key: int) -> int:
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo
