"""Routing policies, reference twin of cpp/src/policies.cpp: one class per policy over one
read-only View of a decision's inputs, each owning its own state (sticky's ring, ttft's
pending cache). kvroute.config documents the rules; expressions here match the C++ ones
operation for operation so both implementations decide bit for bit alike.

Adding a policy touches four files: cpp/include/kvroute/policy.hpp (enum value and name),
cpp/src/policies.cpp (class and factory case), this module (class and POLICIES entry) and
kvroute/config.py (parameters and documentation).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

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
class View:
    """One decision's inputs, read-only to every policy; lists are indexed by replica id.

    match: blocks each replica is scored as holding (index, speculative and pending match,
    rounded down to whole engine blocks, 0 when shorter than min_match_tokens).
    inflight, queued, prefill_requests, prefill_blocks, decode_blocks: the router's own
    accounting plus the external load other routers reported (Router.set_external_load).
    """

    hashes: list[int]
    tokens: int
    block_size: int
    session: str | None
    match: list[int]
    inflight: list[int]
    queued: list[int]
    prefill_requests: list[int]
    prefill_blocks: list[int]
    decode_blocks: list[int]
    waiting: list[int | None]
    kv_usage: list[float | None]
    eligible: list[int]

    def match_tokens(self, r: int) -> int:
        """Matched tokens of replica r, at most the prompt."""
        return min(self.match[r] * self.block_size, self.tokens)


def argmin(order: Sequence[int], key: Callable[[int], Any]) -> int:
    """First candidate with the smallest key: ties go to the earliest in `order`."""
    best = order[0]
    best_key = key(best)
    for r in order[1:]:
        k = key(r)
        if k < best_key:
            best, best_key = r, k
    return best


def argmax(order: Sequence[int], key: Callable[[int], Any]) -> int:
    """First candidate with the largest key."""
    best = order[0]
    best_key = key(best)
    for r in order[1:]:
        k = key(r)
        if k > best_key:
            best, best_key = r, k
    return best


def top_match(v: View, order: Sequence[int]) -> int:
    """The longest scored match among the candidates (0 if none)."""
    return max(0, max(v.match[r] for r in order))


def generic_reason(v: View, order: Sequence[int], chosen: int) -> str:
    """"miss" when nobody matched, "affinity" when the choice holds the longest match."""
    top = top_match(v, order)
    if top == 0:
        return "miss"
    return "affinity" if v.match[chosen] == top else "load"


def mean_of(values: list[int], rs: Sequence[int]) -> float:
    """Mean of values[r] over rs (an integer sum, then one division, as in C++)."""
    return sum(values[r] for r in rs) / len(rs)


class Policy:
    """One routing rule and the state it owns; the Router calls it under its lock."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        self.saturation = session_saturation

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        """(replica, reason) among `order`, least recently chosen first."""
        raise NotImplementedError

    def saturated(self, v: View, b: int) -> bool:
        """Whether a session's bound replica b is too loaded to keep it."""
        return v.inflight[b] > max(1.0, self.saturation * mean_of(v.inflight, v.eligible))

    def extends_match(self) -> bool:
        """Whether extend_match may change anything now (False skips it and its rounding)."""
        return False

    def extend_match(self, hashes: list[int], eligible: list[int], match: list[int]) -> None:
        """Raise match[r] (eligible r) with what the policy knows beyond the index."""

    def replica_added(self, r: int, name: str) -> None:
        """A replica joined the fleet with id r."""

    def replica_removed(self, r: int, name: str) -> None:
        """Replica r left the fleet."""

    def reserved(self, handle: int, r: int, hashes: list[int]) -> None:
        """A request was reserved on replica r."""

    def released(self, handle: int, r: int) -> None:
        """A request on r produced its first token, finished, or expired."""


class RoundRobin(Policy):
    """The least recently chosen eligible replica."""

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        return order[0], "balance"


class Random(Policy):
    """Uniform from the seeded generator."""

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        return order[rng.next() % len(order)], "balance"


class LeastLoaded(Policy):
    """Fewest in-flight requests."""

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        return argmin(order, lambda r: v.inflight[r]), "balance"


class PowerOfTwo(Policy):
    """Two distinct draws; the one with fewer in flight (the first on a tie)."""

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        n = len(order)
        if n == 1:
            return order[0], "balance"
        i = rng.next() % n
        j = rng.next() % (n - 1)
        if j >= i:
            j += 1
        a, b = order[i], order[j]
        return (b if v.inflight[b] < v.inflight[a] else a), "balance"


class Sticky(Policy):
    """Consistent hashing with bounded loads; the ring is updated per membership change."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.vnodes: int = params["vnodes"]
        self.bound: float | None = params["bound"]
        self.keys: list[int] = []  # sorted ring positions
        self.owners: list[int] = []  # replica at each position
        self.ring: list[tuple[int, int]] = []  # (position, replica), sorted

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        if v.session is not None:
            key = mix64(fnv1a64(v.session.encode("utf-8")))
        elif v.hashes:
            key = mix64(v.hashes[0])
        else:
            return order[0], "balance"
        allowed = set(order)
        # Capacity over every eligible replica, also when a saturated bound one is excluded.
        cap = self.capacity(v) if self.bound is not None else None
        ring = self.ring
        start = bisect.bisect_left(ring, (key, 0))
        first = True
        for i in range(len(ring)):
            r = ring[(start + i) % len(ring)][1]
            if r not in allowed:
                continue
            if cap is None or v.inflight[r] < cap:
                return r, "hash" if first else "overflow"
            first = False
        raise RuntimeError("Router invariant broken: bounded loads found no replica below capacity")

    def saturated(self, v: View, b: int) -> bool:
        return self.bound is not None and v.inflight[b] >= self.capacity(v)

    def capacity(self, v: View) -> int:
        """ceil(bound * (in flight over eligible + 1) / eligible)."""
        assert self.bound is not None
        total = sum(v.inflight[r] for r in v.eligible)
        return math.ceil(self.bound * (total + 1) / len(v.eligible))

    def positions(self, name: str) -> list[int]:
        """The replica's vnodes ring positions."""
        base = fnv1a64(name.encode("utf-8"))
        return [mix64((base + k * _GOLDEN) & _M64) for k in range(self.vnodes)]

    def replica_added(self, r: int, name: str) -> None:
        # Sorted new entries merged into the sorted ring: Timsort merges the two runs.
        self.ring = sorted(self.ring + sorted((pos, r) for pos in self.positions(name)))

    def replica_removed(self, r: int, name: str) -> None:
        self.ring = [e for e in self.ring if e[1] != r]


class Linear(Policy):
    """w_affinity * matched tokens - w_load * queued tokens, with the escape rule."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.wa, self.wl, self.escape = params["w_affinity"], params["w_load"], params["escape_factor"]

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        wa, wl, queued = self.wa, self.wl, v.queued

        def score(r: int) -> float:
            return wa * v.match_tokens(r) - wl * queued[r]

        top = max(v.match_tokens(r) for r in order)
        if top == 0:
            return argmax(order, score), "miss"
        best_aff = next(r for r in order if v.match_tokens(r) == top)
        if queued[best_aff] > self.escape * mean_of(queued, order):
            return argmin(order, lambda r: queued[r]), "load"
        chosen = argmax(order, score)
        return chosen, "affinity" if v.match_tokens(chosen) == top else "load"

    def saturated(self, v: View, b: int) -> bool:
        return v.queued[b] > self.escape * mean_of(v.queued, v.eligible)


class SGLang(Policy):
    """SGLang's cache-aware rule: balance when imbalanced, else the longest match above
    cache_threshold, else least loaded."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.threshold = params["cache_threshold"]
        self.abs, self.rel = params["balance_abs_threshold"], params["balance_rel_threshold"]

    def imbalanced(self, hi: int, lo: int) -> bool:
        """max - min above both thresholds."""
        return hi - lo > self.abs and hi > lo * self.rel

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        inflight = v.inflight
        if self.imbalanced(max(inflight[r] for r in order), min(inflight[r] for r in order)):
            return argmin(order, lambda r: inflight[r]), "load"
        top = top_match(v, order)
        rate = min(top * v.block_size, v.tokens) / v.tokens if v.tokens > 0 else 0.0
        if rate > self.threshold:
            return next(r for r in order if v.match[r] == top), "affinity"
        return argmin(order, lambda r: inflight[r]), "miss"

    def saturated(self, v: View, b: int) -> bool:
        return self.imbalanced(v.inflight[b], min(v.inflight[r] for r in v.eligible))


class Dynamo(Policy):
    """Dynamo's KV-router cost: new prefill blocks plus active decode blocks."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.scale, self.temp = params["prefill_load_scale"], params["temperature"]

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        pb = len(v.hashes)
        costs = [
            self.scale * max(v.prefill_blocks[r] + pb - v.match[r], 0) + float(v.decode_blocks[r] + pb)
            for r in order
        ]
        chosen = order[self.sample(costs, rng) if self.temp > 0.0 else self.cheapest(costs)]
        return chosen, generic_reason(v, order, chosen)

    @staticmethod
    def cheapest(costs: list[float]) -> int:
        """Index of the first lowest cost."""
        best = 0
        for i in range(1, len(costs)):
            if costs[i] < costs[best]:
                best = i
        return best

    def sample(self, costs: list[float], rng: SplitMix64) -> int:
        """Softmax sample over -normalized cost / temperature."""
        lo, hi = min(costs), max(costs)
        span = hi - lo
        weights = [math.exp(-((c - lo) / span if span > 0.0 else 0.0) / self.temp) for c in costs]
        total = 0.0
        for w in weights:
            total += w
        u = rng.unit() * total
        acc = 0.0
        for i, w in enumerate(weights):
            acc += w
            if u < acc:
                return i
        return len(costs) - 1


class LLMD(Policy):
    """llm-d's weighted scorers: prefix, queue and KV usage."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.wp, self.wq, self.wk = params["w_prefix"], params["w_queue"], params["w_kv"]

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        pb = len(v.hashes)
        q = {r: (v.waiting[r] if v.waiting[r] is not None else v.prefill_requests[r]) for r in order}
        qmax, qmin = max(q.values()), min(q.values())

        def score(r: int) -> float:
            prefix = v.match[r] / pb if pb > 0 else 0.0
            queue = (qmax - q[r]) / (qmax - qmin) if qmax > qmin else 1.0
            usage = v.kv_usage[r]
            kv = 1.0 - (usage if usage is not None else 0.0)
            return self.wp * prefix + self.wq * queue + self.wk * kv

        chosen = argmax(order, score)
        return chosen, generic_reason(v, order, chosen)


class Preble(Policy):
    """Preble's explore/exploit with a decode-weighted cost."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.dw = params["decode_weight"]

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        def cost(r: int) -> float:
            return float(v.queued[r] + v.tokens - v.match_tokens(r)) + self.dw * v.inflight[r]

        top = top_match(v, order)
        mt = min(top * v.block_size, v.tokens)
        # Exploit: the cheapest among the longest-match holders; else explore all.
        pool = [r for r in order if v.match[r] == top] if mt > v.tokens - mt else order
        chosen = argmin(pool, cost)
        return chosen, generic_reason(v, order, chosen)


class TTFT(Policy):
    """Lowest estimated time to first token; owns the pending cache (prompts routed to a
    replica that have not produced their first token)."""

    def __init__(self, params: Mapping[str, Any], session_saturation: float) -> None:
        super().__init__(params, session_saturation)
        self.pending: list[dict[int, list[int]]] = []  # per replica: handle -> prompt hashes
        self.step = params["step_tokens"]
        self.kvw = params["kv_weight"]
        self.batch = params["batch_tokens"]
        self.fleet = params["fleet_weight"]

    def cost(self, v: View, r: int, least: int) -> float:
        """Estimated time to first token on r, in tokens at the prefill rate (kvroute.config)."""
        u = v.tokens - v.match_tokens(r)
        w = v.queued[r] + u
        d = v.inflight[r] - v.prefill_requests[r]
        cap = max(self.batch - d, 1)
        steps = max(1, (w + cap - 1) // cap)
        kv = float(v.decode_blocks[r] * v.block_size)
        return float(w) + float(steps) * (float(d) + self.step + self.kvw * kv) + self.fleet * float(u - least)

    def choose(self, v: View, order: list[int], rng: SplitMix64) -> tuple[int, str]:
        # Ties: the longer match, then fewer in flight, then the least recently chosen.
        top = top_match(v, order)
        least = v.tokens - min(top * v.block_size, v.tokens)
        chosen = argmin(order, lambda r: (self.cost(v, r, least), -v.match[r], v.inflight[r]))
        return chosen, generic_reason(v, order, chosen)

    def extends_match(self) -> bool:
        return any(self.pending)

    def extend_match(self, hashes: list[int], eligible: list[int], match: list[int]) -> None:
        # A prompt queued behind a request with the same leading blocks on the same FIFO
        # replica finds them cached when its own prefill starts: count them as matched.
        p = len(hashes)
        for r in eligible:
            m = match[r]
            for other in self.pending[r].values():
                n = min(len(other), p)
                if n <= m:
                    continue
                k = 0
                while k < n and other[k] == hashes[k]:
                    k += 1
                m = max(m, k)
            match[r] = m

    def replica_added(self, r: int, name: str) -> None:
        while len(self.pending) <= r:
            self.pending.append({})

    def replica_removed(self, r: int, name: str) -> None:
        self.pending[r] = {}

    def reserved(self, handle: int, r: int, hashes: list[int]) -> None:
        self.pending[r][handle] = hashes

    def released(self, handle: int, r: int) -> None:
        self.pending[r].pop(handle, None)


#: policy name -> its class; tests check it names exactly kvroute.config's policies.
POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "random": Random,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "sticky": Sticky,
    "linear": Linear,
    "sglang": SGLang,
    "dynamo": Dynamo,
    "llmd": LLMD,
    "preble": Preble,
    "ttft": TTFT,
}


def make_policy(name: str, params: Mapping[str, Any], session_saturation: float) -> Policy:
    """The policy `name` (ValueError for an unknown one, as the native factory)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy '{name}'")
    return cls(params, session_saturation)
