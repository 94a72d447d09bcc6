"""The fleet model: one vLLM-like Engine per replica (kvroute.sim.engine), driven by events.

Each replica is an Engine (see its module docstring for the scheduler, KV memory and step
time it models, and the vLLM sources it follows) with FleetParams.engine_config(): a
workload's request is added to its replica's engine when the router places it; the
engine steps back to back while it has work, each step's outputs visible at its end:
the first token (TTFT), then one token per step until output_tokens (completion).

The router (a kvroute.Router) routes each arrival with route_hashes(); prefill_done() is
called at the first token and finish() at completion. Before each decision the fleet
reports every replica's load (report_load: waiting and running requests, KV usage), as a
gateway scraping the engines' metrics would (FleetParams.report_load). What the router
knows of the caches:

- "precise": the engines' own KV events (BlockStored, BlockRemoved) are applied to
  router.index event_delay seconds after the step that produced them ended. Engines do
  not de-duplicate blocks (vLLM does not), so the fleet counts copies per replica and
  removes a hash from the router's index when its last copy goes.
- "approximate": the router inserts each routed prompt into its own index, bounded to the
  engines' block count; the fleet tells it nothing.
- "hybrid": both (the router's speculative index plus the events).

Time advances through two heaps, arrivals and step ends (ties: step ends first, then in
the order they were scheduled), so a run is a pure function of the workload, the
parameters and the seed. Decode-only stretches are run in one Engine.run_decodes() call up
to the next moment something could observe the replica (the next known arrival, or the
earliest a closed-loop client could send its next turn): the same run as step by step,
far fewer Python calls.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .._backend import backend
from . import metrics as _metrics
from .engine import Engine, EngineConfig, EngineRequest, StepResult
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from .routers import RouterSpec, router_spec
from .workloads import Workload

KNOWLEDGE = ("precise", "approximate", "hybrid")

_ENGINE_DEFAULTS = EngineConfig()

#: Policies whose decisions ignore the prefix index.
_CACHE_BLIND = frozenset({"round_robin", "random", "least_loaded", "power_of_two", "sticky"})


@dataclass(frozen=True)
class FleetParams:
    """The simulated fleet: replicas of one engine model (kvroute.sim.engine defaults:
    Llama-3.1-8B on an A100-40GB each).

    replicas (8). cache_tokens: KV memory per replica in tokens (163,840), shared by
    running requests and the prefix cache, used in blocks of the workload's block size.
    max_num_batched_tokens (8192), max_num_seqs (256), long_prefill_token_threshold (0),
    cache_on_schedule (False), step_fixed_s, per_token_s, per_kv_token_s: the engine's
    (EngineConfig documents them). knowledge: "precise", "approximate" or "hybrid" (module
    docstring). event_delay: seconds between a step's end and the router seeing its KV
    events (0). report_load: give the router each engine's waiting/running/kv_usage before
    every decision (True). seed: seeds the router's random choices.
    """

    replicas: int = 8
    cache_tokens: int = 163_840
    max_num_batched_tokens: int = _ENGINE_DEFAULTS.max_num_batched_tokens
    max_num_seqs: int = _ENGINE_DEFAULTS.max_num_seqs
    long_prefill_token_threshold: int = 0
    cache_on_schedule: bool = False
    step_fixed_s: float = _ENGINE_DEFAULTS.step_fixed_s
    per_token_s: float = _ENGINE_DEFAULTS.per_token_s
    per_kv_token_s: float = _ENGINE_DEFAULTS.per_kv_token_s
    knowledge: str = "precise"
    event_delay: float = 0.0
    report_load: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("replicas", 1), ("cache_tokens", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        value = self.event_delay
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"event_delay must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"event_delay must be a finite number >= 0, got {value!r}")
        if self.knowledge not in KNOWLEDGE:
            raise ValueError(f"knowledge must be one of {', '.join(KNOWLEDGE)}, got {self.knowledge!r}")
        if not isinstance(self.report_load, bool):
            raise TypeError(f"report_load must be a bool, got {type(self.report_load).__name__}")
        self.engine_config(16)  # the engine parameters' own checks and messages
        if self.per_token_s <= 0:
            raise ValueError(f"per_token_s must be a finite number > 0, got {self.per_token_s!r}")

    @property
    def prefill_rate(self) -> float:
        """Prefill tokens per second of a full step (1 / per_token_s)."""
        return 1.0 / self.per_token_s

    def cache_blocks(self, block_tokens: int) -> int:
        """KV memory per replica in whole blocks of block_tokens (at least 1)."""
        return max(1, self.cache_tokens // block_tokens)

    def engine_config(self, block_tokens: int) -> EngineConfig:
        """The EngineConfig of every replica for a workload hashed in blocks of block_tokens."""
        return EngineConfig(
            block_size=block_tokens, num_kv_blocks=self.cache_blocks(block_tokens),
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            cache_on_schedule=self.cache_on_schedule, step_fixed_s=self.step_fixed_s,
            per_token_s=self.per_token_s, per_kv_token_s=self.per_kv_token_s)


class _Request:
    __slots__ = ("client", "turn", "arrival", "replica", "handle", "cached", "ttft", "finish", "predicted")

    def __init__(self, client: int, turn: int, arrival: float) -> None:
        self.client = client
        self.turn = turn
        self.arrival = arrival
        self.replica = -1
        self.handle = -1
        self.cached = 0
        self.ttft = math.nan
        self.finish = math.nan
        self.predicted = 0


@dataclass(frozen=True)
class Record:
    """Per-request results of a run, in arrival order (numpy arrays of equal length).

    client, turn: which request (indices into workload.clients and its turns). first:
    first turn of a conversation. arrival, ttft, finish (completion time): seconds.
    output_tokens: tokens generated. cached_tokens: the engine's prefix hit at admission;
    predicted_cached_tokens: what the router expected. prefill_s: compute seconds of its
    uncached prompt tokens (uncached x per_token_s). A request longer than an engine's KV
    memory is rejected: ttft nan, finish = its arrival, cached 0.
    """

    client: np.ndarray
    turn: np.ndarray
    first: np.ndarray
    arrival: np.ndarray
    replica: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    predicted_cached_tokens: np.ndarray
    ttft: np.ndarray
    finish: np.ndarray
    prefill_s: np.ndarray


@dataclass(frozen=True)
class SimResult:
    """A run: the metrics, per-request records, router and engine stats, wall and CPU seconds."""

    router: str
    workload: str
    metrics: _metrics.Metrics
    records: Record
    router_stats: dict[str, Any]
    wall_s: float
    cpu_s: float = 0.0
    engine_stats: tuple[dict[str, Any], ...] = ()

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


class _Knowledge:
    """Applies engine KV events to the router's index, counting copies per replica."""

    def __init__(self, index: Any, replicas: int) -> None:
        self.index = index
        self.copies: list[dict[int, int]] = [{} for _ in range(replicas)]
        self.orphans = 0  # stores whose parent the index no longer had (under-claimed)

    def apply(self, r: int, events: list[Any], now: float) -> None:
        copies = self.copies[r]
        index = self.index
        for ev in events:
            if type(ev) is BlockStored:
                hs = ev.block_hashes
                for h in hs:
                    copies[h] = copies.get(h, 0) + 1
                arr = np.array(hs, dtype=np.uint64)
                if ev.parent_block_hash is None:
                    index.insert(r, arr, now)
                else:
                    try:
                        index.store_after(r, ev.parent_block_hash, arr, now)
                    except KeyError:
                        self.orphans += 1
            elif type(ev) is BlockRemoved:
                gone = []
                for h in ev.block_hashes:
                    n = copies[h] - 1
                    if n:
                        copies[h] = n
                    else:
                        del copies[h]
                        gone.append(h)
                if gone:  # now: a later store of the same step may bring a hash back
                    index.remove(r, np.array(gone, dtype=np.uint64))
            elif type(ev) is AllBlocksCleared:  # pragma: no cover - the fleet never resets
                copies.clear()
                index.clear_replica(r)


def _min_think(workload: Workload) -> float:
    """The earliest a closed-loop client can send its next turn after a completion."""
    thinks = [t.think_time for c in workload.clients for t in c.turns[1:]]
    return min(thinks) if thinks else math.inf


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
    progress(done, total) is called as requests complete. impl: the module whose Router
    is used (kvroute._native or kvroute.reference; default: the backend kvroute uses).
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
    run = _Run(workload, fleet, router, True if sessions is None else bool(sessions), assign, progress)
    started = time.perf_counter()
    cpu_started = time.process_time()
    run.loop()
    rec, m = run.measure()
    stats = dict(router.stats()) if router is not None else {}
    if run.knowledge is not None:
        stats["event_orphans"] = run.knowledge.orphans
    return SimResult(name, workload.name, m, rec, stats, time.perf_counter() - started,
                     time.process_time() - cpu_started, tuple(e.stats() for e in run.engines))


class _Run:
    """One simulation's state and event loop (see the module docstring)."""

    def __init__(self, workload: Workload, fleet: FleetParams, router: Any, use_sessions: bool,
                 assign: Callable[[int, int, float], int] | None,
                 progress: Callable[[int, int], None] | None) -> None:
        self.wl = workload
        self.fleet = fleet
        self.router = router
        self.use_sessions = use_sessions
        self.assign = assign
        self.progress = progress
        n = fleet.replicas
        cfg = fleet.engine_config(workload.block_tokens)
        self.engines = [Engine(cfg) for _ in range(n)]
        self.kv_blocks = cfg.num_kv_blocks
        self.rejected = 0
        self.names = [f"replica-{i}" for i in range(n)]
        # Policies that never read the index do not need it fed (their predictions stay 0).
        feed = router is not None and fleet.knowledge in ("precise", "hybrid") and \
            getattr(router.config, "policy", "") not in _CACHE_BLIND
        self.knowledge = _Knowledge(router.index, n) if feed else None
        self.delay = float(fleet.event_delay)
        self.min_think = _min_think(workload)
        self.arrivals: list[tuple[float, int, int, int]] = []
        self.events: list[tuple[float, int, int, Any]] = []  # (time, seq, replica or -1-replica, payload)
        self.seq = 0
        for c_idx, c in enumerate(workload.clients):
            if c.turns:
                self.arrivals.append((float(c.start), self._next(), c_idx, 0))
        heapq.heapify(self.arrivals)
        self.busy = [False] * n
        self.idle: set[int] = set()  # engines with new work to start after this instant's arrivals
        self.requests: list[_Request] = []
        self.rebinds = 0
        self.stranded = 0
        self.done = 0
        self.now = 0.0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def loop(self) -> None:
        arrivals, events = self.arrivals, self.events
        pop = heapq.heappop
        while arrivals or events:
            if events and (not arrivals or events[0][0] <= arrivals[0][0]):
                t, _, who, payload = pop(events)
                self.now = t
                if who >= 0:
                    self._step_end(who, payload, t)
                else:
                    self.knowledge.apply(-1 - who, payload, t)  # type: ignore[union-attr]
            else:
                t, _, c_idx, t_idx = pop(arrivals)
                self.now = t
                self._arrive(c_idx, t_idx, t)
                if self.idle and not (arrivals and arrivals[0][0] <= t):
                    # Idle engines start once every request of this instant is queued:
                    # requests that arrive together are admitted in the same step.
                    for r in sorted(self.idle):
                        self._start_step(r, t)
                    self.idle.clear()

    def _arrive(self, c_idx: int, t_idx: int, now: float) -> None:
        turn = self.wl.clients[c_idx].turns[t_idx]
        req = _Request(c_idx, t_idx, now)
        rid = len(self.requests)
        self.requests.append(req)
        router = self.router
        if router is not None:
            if self.fleet.report_load:
                for r, eng in enumerate(self.engines):
                    waiting, running, usage = eng.load()
                    router.report_load(self.names[r], waiting=waiting, running=running, kv_usage=usage)
            d = router.route_hashes(turn.hashes, turn.prompt_tokens,
                                    session=turn.session if self.use_sessions else None, now=now)
            req.replica = int(d.replica_id)
            req.handle = int(d.handle)
            req.predicted = int(d.cached_tokens)
            if d.binding == "rebound":
                self.rebinds += 1
            self.stranded += int(d.stranded_blocks)
        else:
            req.replica = int(self.assign(c_idx, t_idx, now))  # type: ignore[misc]
            if not 0 <= req.replica < len(self.engines):
                raise ValueError(f"assign returned replica {req.replica}, out of range [0, {len(self.engines)})")
        r = req.replica
        if -(-(turn.prompt_tokens + turn.output_tokens) // self.wl.block_tokens) > self.kv_blocks:
            # Longer than the KV memory: an engine rejects it up front (vLLM: longer than
            # max_model_len). Counted in Metrics.rejected, left out of the TTFT statistics.
            self.rejected += 1
            self._complete(req, now)
            return
        self.engines[r].add_request(
            EngineRequest(str(rid), None, turn.output_tokens, now, block_hashes=turn.after_hashes,
                          num_prompt_tokens=turn.prompt_tokens), now)
        if not self.busy[r]:
            self.idle.add(r)

    def _horizon(self, now: float) -> float:
        nxt = self.arrivals[0][0] if self.arrivals else math.inf
        return min(nxt, now + self.min_think)

    def _start_step(self, r: int, now: float) -> StepResult | None:
        """Start replica r's next step (or decode stretch) at `now`; the step started (None
        where a subclass parks the replica instead)."""
        eng = self.engines[r]
        res = eng.run_decodes(now, self._horizon(now))
        if res is None:
            res = eng.step(now)
        self.busy[r] = True
        heapq.heappush(self.events, (res.end, self._next(), r, res))
        return res

    def _step_end(self, r: int, res: StepResult, now: float) -> None:
        self.busy[r] = False
        if res.events and self.knowledge is not None:
            if self.delay > 0:
                heapq.heappush(self.events, (now + self.delay, self._next(), -1 - r, res.events))
            else:
                self.knowledge.apply(r, res.events, now)
        router = self.router
        for o in res.outputs:
            req = self.requests[int(o.request_id)]
            if o.is_first_token:
                req.ttft = now - req.arrival
                req.cached = o.cached_tokens
                if router is not None:
                    router.prefill_done(req.handle, now=now)
            if o.finished:
                self._complete(req, now)
        if self.engines[r].has_work():
            self._start_step(r, now)

    def _complete(self, req: _Request, now: float) -> None:
        req.finish = now
        if self.router is not None:
            self.router.finish(req.handle, now=now)
        client = self.wl.clients[req.client]
        if req.turn + 1 < len(client.turns):
            nxt = client.turns[req.turn + 1]
            heapq.heappush(self.arrivals, (now + nxt.think_time, self._next(), req.client, req.turn + 1))
        self.done += 1
        total = self.wl.num_requests
        if self.progress is not None and (self.done % 64 == 0 or self.done == total):
            self.progress(self.done, total)

    def measure(self) -> tuple[Record, _metrics.Metrics]:
        clients = self.wl.clients
        reqs = self.requests
        turns = [clients[q.client].turns[q.turn] for q in reqs]
        prompt = np.array([t.prompt_tokens for t in turns], dtype=np.int64)
        cached = np.array([q.cached for q in reqs], dtype=np.int64)
        served = np.array([not math.isnan(q.ttft) for q in reqs], dtype=bool)
        rec = Record(
            client=np.array([q.client for q in reqs], dtype=np.int64),
            turn=np.array([q.turn for q in reqs], dtype=np.int64),
            first=np.array([t.first for t in turns], dtype=bool),
            arrival=np.array([q.arrival for q in reqs], dtype=np.float64),
            replica=np.array([q.replica for q in reqs], dtype=np.int64),
            prompt_tokens=prompt,
            output_tokens=np.array([t.output_tokens for t in turns], dtype=np.int64),
            cached_tokens=cached,
            predicted_cached_tokens=np.array([q.predicted for q in reqs], dtype=np.int64),
            ttft=np.array([q.ttft for q in reqs], dtype=np.float64),
            finish=np.array([q.finish for q in reqs], dtype=np.float64),
            prefill_s=np.where(served, (prompt - cached) * self.fleet.per_token_s, 0.0),
        )
        ok = ~np.isnan(rec.ttft)  # served (not rejected)
        m = _metrics.compute(
            prompt_tokens=rec.prompt_tokens[ok], cached_tokens=rec.cached_tokens[ok], ttft=rec.ttft[ok],
            first_turn=rec.first[ok], replica=rec.replica[ok], prefill_s=rec.prefill_s[ok],
            num_replicas=len(self.engines), rebinds=self.rebinds, stranded_blocks=self.stranded,
            predicted_cached_tokens=rec.predicted_cached_tokens[ok] if self.router is not None else None,
            makespan_s=self.now, arrival=rec.arrival[ok], finish=rec.finish[ok],
            output_tokens=rec.output_tokens[ok],
            preemptions=sum(e.stats()["preemptions"] for e in self.engines), rejected=self.rejected,
        )
        return rec, m


__all__ = ["FleetParams", "KNOWLEDGE", "Record", "SimResult", "make_router", "simulate"]
