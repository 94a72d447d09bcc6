"""The fleet model: replicas with prefix caches and FIFO prefill queues, driven by events.

Per replica (FleetParams documents each parameter):

- a KV prefix cache of cache_tokens // block_tokens blocks. All replicas' caches live in
  one kvroute.PrefixIndex with that capacity per replica, which evicts each replica's
  least-recently-used blocks, a chain's suffix before its prefix.
- one FIFO prefill queue, one request at a time. When a request reaches the head, the
  cache is looked up (the leading blocks the replica holds are its cached tokens; they
  are touched, so they are the most recently used) and its prefill takes
  uncached_tokens / prefill_rate + prefill_overhead seconds.
- the prompt's blocks enter the cache when its prefill finishes, never before: a block
  is reusable only once the prefill that writes it is done, so identical requests
  prefilling at the same time on different replicas all miss. The first token comes at
  that moment (TTFT).
- decode takes output_tokens * time_per_output_token seconds, outside the prefill queue
  (decode runs batched beside prefill); at completion the prompt's and the output's
  full blocks are in the cache.

The router (a kvroute.Router) routes each arrival with route_hashes(); prefill_done() is
called at the first token and finish() at completion. Its knowledge of the caches:

- "precise": every change of a replica's cache (blocks stored at prefill end and at
  completion, blocks evicted) is applied to router.index, event_delay seconds later.
- "approximate": the router inserts each routed prompt into its own index, bounded to the
  same number of blocks per replica as the caches; the fleet tells it nothing.
- "hybrid": both (the router's speculative index plus the events).

Events are processed in time order, ties in the order they were scheduled, so a run is a
pure function of the workload, the parameters and the seed.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .._backend import backend
from . import metrics as _metrics
from .routers import RouterSpec, router_spec
from .workloads import Workload

KNOWLEDGE = ("precise", "approximate", "hybrid")


@dataclass(frozen=True)
class FleetParams:
    """The simulated fleet. Defaults model an 8B-class model on one GPU per replica.

    replicas: number of replicas (8). cache_tokens: KV cache per replica in tokens (163,840:
    about 22 GB at 128 KiB per token), used at block granularity. prefill_rate: prompt
    tokens a replica prefills per second (10,000). prefill_overhead: fixed seconds per
    prefill (0.02; scheduling and the first decode step). time_per_output_token: decode
    seconds per output token (0.02). knowledge: how the router learns what the caches
    hold, "precise", "approximate" or "hybrid" (see the module docstring). event_delay:
    seconds between a cache change and the router seeing it (precise and hybrid; 0).
    seed: seeds the router's random choices.
    """

    replicas: int = 8
    cache_tokens: int = 163_840
    prefill_rate: float = 10_000.0
    prefill_overhead: float = 0.02
    time_per_output_token: float = 0.02
    knowledge: str = "precise"
    event_delay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("replicas", 1), ("cache_tokens", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name, strict in (("prefill_rate", True), ("prefill_overhead", False),
                             ("time_per_output_token", False), ("event_delay", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (strict and value == 0):
                raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} 0, got {value!r}")
        if self.knowledge not in KNOWLEDGE:
            raise ValueError(f"knowledge must be one of {', '.join(KNOWLEDGE)}, got {self.knowledge!r}")

    def cache_blocks(self, block_tokens: int) -> int:
        """Cache capacity per replica in whole blocks of block_tokens (at least 1)."""
        return max(1, self.cache_tokens // block_tokens)


# Event kinds; the heap orders (time, sequence number), so equal times keep schedule order.
_ARRIVE, _PREFILL_END, _DECODE_END, _KNOW = range(4)


class _Request:
    __slots__ = ("client", "turn", "arrival", "replica", "handle", "cached", "start", "ttft",
                 "prefill_s", "predicted")

    def __init__(self, client: int, turn: int, arrival: float) -> None:
        self.client = client
        self.turn = turn
        self.arrival = arrival
        self.replica = -1
        self.handle = -1
        self.cached = 0
        self.start = math.nan
        self.ttft = math.nan
        self.prefill_s = 0.0
        self.predicted = 0


@dataclass(frozen=True)
class Record:
    """Per-request results of a run, in arrival order (numpy arrays of equal length).

    client, turn: which request (indices into workload.clients and its turns). first:
    first turn of a conversation. arrival, start (prefill start), ttft: seconds.
    cached_tokens: what the replica's cache actually saved; predicted_cached_tokens:
    what the router expected. prefill_s: seconds the request held the prefill queue.
    """

    client: np.ndarray
    turn: np.ndarray
    first: np.ndarray
    arrival: np.ndarray
    replica: np.ndarray
    start: np.ndarray
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    predicted_cached_tokens: np.ndarray
    ttft: np.ndarray
    prefill_s: np.ndarray


@dataclass(frozen=True)
class SimResult:
    """A run: the metrics, per-request records, router stats, wall and CPU seconds."""

    router: str
    workload: str
    metrics: _metrics.Metrics
    records: Record
    router_stats: dict[str, Any]
    wall_s: float
    cpu_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The metrics and identifiers as JSON-ready values (records left out)."""
        return {"router": self.router, "workload": self.workload, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                **self.metrics.as_dict()}


def make_router(config: Any, fleet: FleetParams, block_tokens: int, impl: Any = None) -> Any:
    """A kvroute.Router for this fleet: config with the fleet's block size, knowledge mode,
    index capacity, prefill rate and seed filled in, and replicas replica-0..N-1.
    impl: the module providing Router (default: kvroute's backend)."""
    cfg = replace(
        config,
        block_size=block_tokens,
        mode=fleet.knowledge,
        # Precise knowledge mirrors the caches exactly, evictions included; an
        # approximate index needs its own bound, the size of the caches it guesses at.
        index_capacity=None if fleet.knowledge == "precise" else fleet.cache_blocks(block_tokens),
        prefill_rate=float(fleet.prefill_rate),
        seed=fleet.seed,
    )
    router = (impl or backend).Router(cfg, [f"replica-{i}" for i in range(fleet.replicas)])
    for i in range(fleet.replicas):
        if router.replica_id(f"replica-{i}") != i:  # pragma: no cover - Router contract
            raise RuntimeError("the router did not give replicas dense ids in order")
    return router


def simulate(
    workload: Workload,
    router: Any = None,
    fleet: FleetParams | None = None,
    *,
    sessions: bool | None = None,
    name: str = "",
    assign: Callable[[int, int, float], int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    impl: Any = None,
) -> SimResult:
    """Run `workload` on a fleet routed by `router` and measure it.

    router: a router name or RouterSpec (kvroute.sim.routers), a kvroute.RouterConfig, or
    a kvroute.Router made by make_router for this fleet and workload. sessions: whether
    the router is given the requests' session ids (default: the spec's choice, else
    True). assign: instead of a router, a function (client index, turn index, now) ->
    replica id that places requests by hand (for experiments and tests of the model).
    progress(done, total) is called as requests complete. impl: the module whose
    PrefixIndex and Router are used (kvroute._native or kvroute.reference; default: the
    backend kvroute uses).
    """
    fleet = fleet or FleetParams()
    if (router is None) == (assign is None):
        raise ValueError("simulate needs exactly one of router and assign")
    if isinstance(router, str):
        router = router_spec(router)
    if isinstance(router, RouterSpec):
        name = name or router.name
        if sessions is None:
            sessions = router.sessions
        router = router.config()
    if router is not None and not hasattr(router, "route_hashes"):
        name = name or getattr(router, "policy", "")
        router = make_router(router, fleet, workload.block_tokens, impl)
    use_sessions = True if sessions is None else bool(sessions)
    started = time.perf_counter()
    cpu_started = time.process_time()
    n = fleet.replicas
    bt = workload.block_tokens
    cache = (impl or backend).PrefixIndex(n, capacity=fleet.cache_blocks(bt), record_evictions=True)
    feed = router is not None and fleet.knowledge in ("precise", "hybrid")
    delay = float(fleet.event_delay)
    rate = float(fleet.prefill_rate)
    overhead = float(fleet.prefill_overhead)
    tpot = float(fleet.time_per_output_token)
    clients = workload.clients
    total = workload.num_requests

    heap: list[tuple[float, int, int, Any]] = []
    seq = 0
    for c_idx, c in enumerate(clients):
        if c.turns:
            heap.append((float(c.start), seq, _ARRIVE, (c_idx, 0)))
            seq += 1
    heapq.heapify(heap)
    queues: list[deque[_Request]] = [deque() for _ in range(n)]
    busy = [False] * n
    requests: list[_Request] = []
    rebinds = 0
    stranded = 0
    done = 0
    now = 0.0
    push = heapq.heappush
    pop = heapq.heappop
    index = router.index if feed else None

    def apply_knowledge(r: int, hashes: np.ndarray, ev_r: np.ndarray, ev_h: np.ndarray, t: float) -> None:
        index.insert(r, hashes, t)
        if ev_h.size:
            for rr in np.unique(ev_r):
                index.remove(int(rr), ev_h[ev_r == rr])

    def store(r: int, hashes: np.ndarray, t: float) -> None:
        nonlocal seq
        cache.insert(r, hashes, t)
        ev_r, ev_h = cache.pop_evictions()
        if index is None:
            return
        if delay > 0:
            push(heap, (t + delay, seq, _KNOW, (r, hashes, ev_r, ev_h)))
            seq += 1
        else:
            apply_knowledge(r, hashes, ev_r, ev_h, t)

    def start_prefill(r: int, req: _Request, t: float) -> None:
        nonlocal seq
        turn = clients[req.client].turns[req.turn]
        m = int(cache.match(turn.hashes)[r])
        if m:
            cache.touch(r, turn.hashes[:m], t)
        req.cached = min(m * bt, turn.prompt_tokens)
        req.start = t
        req.prefill_s = (turn.prompt_tokens - req.cached) / rate + overhead
        busy[r] = True
        push(heap, (t + req.prefill_s, seq, _PREFILL_END, req))
        seq += 1

    while heap:
        now, _, kind, payload = pop(heap)
        if kind == _ARRIVE:
            c_idx, t_idx = payload
            client = clients[c_idx]
            turn = client.turns[t_idx]
            req = _Request(c_idx, t_idx, now)
            requests.append(req)
            if router is not None:
                d = router.route_hashes(turn.hashes, turn.prompt_tokens, session=turn.session if use_sessions else None, now=now)
                req.replica = int(d.replica_id)
                req.handle = int(d.handle)
                req.predicted = int(d.cached_tokens)
                if d.binding == "rebound":
                    rebinds += 1
                stranded += int(d.stranded_blocks)
            else:
                req.replica = int(assign(c_idx, t_idx, now))
                if not 0 <= req.replica < n:
                    raise ValueError(f"assign returned replica {req.replica}, out of range [0, {n})")
            r = req.replica
            if busy[r]:
                queues[r].append(req)
            else:
                start_prefill(r, req, now)
        elif kind == _PREFILL_END:
            req = payload
            r = req.replica
            turn = clients[req.client].turns[req.turn]
            req.ttft = now - req.arrival
            store(r, turn.hashes, now)
            if router is not None:
                router.prefill_done(req.handle, now=now)
            push(heap, (now + turn.output_tokens * tpot, seq, _DECODE_END, req))
            seq += 1
            busy[r] = False
            if queues[r]:
                start_prefill(r, queues[r].popleft(), now)
        elif kind == _DECODE_END:
            req = payload
            client = clients[req.client]
            turn = client.turns[req.turn]
            store(req.replica, turn.after_hashes, now)
            if router is not None:
                router.finish(req.handle, now=now)
            if req.turn + 1 < len(client.turns):
                nxt = client.turns[req.turn + 1]
                push(heap, (now + nxt.think_time, seq, _ARRIVE, (req.client, req.turn + 1)))
                seq += 1
            done += 1
            if progress is not None and (done % 64 == 0 or done == total):
                progress(done, total)
        else:
            apply_knowledge(*payload, now)

    rec = Record(
        client=np.array([q.client for q in requests], dtype=np.int64),
        turn=np.array([q.turn for q in requests], dtype=np.int64),
        first=np.array([clients[q.client].turns[q.turn].first for q in requests], dtype=bool),
        arrival=np.array([q.arrival for q in requests], dtype=np.float64),
        replica=np.array([q.replica for q in requests], dtype=np.int64),
        start=np.array([q.start for q in requests], dtype=np.float64),
        prompt_tokens=np.array([clients[q.client].turns[q.turn].prompt_tokens for q in requests], dtype=np.int64),
        cached_tokens=np.array([q.cached for q in requests], dtype=np.int64),
        predicted_cached_tokens=np.array([q.predicted for q in requests], dtype=np.int64),
        ttft=np.array([q.ttft for q in requests], dtype=np.float64),
        prefill_s=np.array([q.prefill_s for q in requests], dtype=np.float64),
    )
    m = _metrics.compute(
        prompt_tokens=rec.prompt_tokens,
        cached_tokens=rec.cached_tokens,
        ttft=rec.ttft,
        first_turn=rec.first,
        replica=rec.replica,
        prefill_s=rec.prefill_s,
        num_replicas=n,
        rebinds=rebinds,
        stranded_blocks=stranded,
        predicted_cached_tokens=rec.predicted_cached_tokens if router is not None else None,
        makespan_s=now,
    )
    stats = dict(router.stats()) if router is not None else {}
    return SimResult(name, workload.name, m, rec, stats, time.perf_counter() - started,
                     time.process_time() - cpu_started)


__all__ = ["FleetParams", "KNOWLEDGE", "Record", "SimResult", "make_router", "simulate"]
