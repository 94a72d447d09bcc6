"""The ideal fleet: the limit every router is measured against, at the same size.

One shared prefix cache holding the fleet's total KV memory, and one central queue from
which any idle replica takes the next request. Built from the fleet model's own parts
(kvroute.sim.fleet, kvroute.sim.engine), so only those two things differ:

- KV memory: the replicas' engines share one pool of replicas x cache_tokens blocks (one
  free queue, one hash table, one LRU order): a block any replica computed is a prefix
  hit on every replica, and a replica may hold more than its share while others hold
  less. Each engine keeps its own scheduler, token budget, max_num_seqs and step time,
  so a request is still computed by one replica at one replica's speed. A replica whose
  waiting head cannot get blocks (others hold them) waits until a step elsewhere ends;
  while any replica has a request waiting, every replica steps one at a time (no batched
  decode stretch, whose effect the engine model applies at its start) so the waiting
  request gets blocks when they are freed, not before.
- Queue: requests wait in one FIFO queue; a replica takes the head while the prompt
  tokens it has yet to compute (waiting, or running before their first token) are fewer
  than one step's token budget (max_num_batched_tokens) and it runs fewer than
  max_num_seqs: the one with the fewest such tokens, then one with no step in flight,
  then the lowest index. No request queues behind a replica's prefill while another
  replica has room in its next step, and no router decision is made.

Not a strict bound on every run: LRU is not optimal, so splitting the cache can, rarely,
keep a block one pooled LRU evicts, and a queue reordered by cache could beat FIFO on
TTFT; a fraction above 1 shows it. FIFO and LRU are what engines run.

`simulate_ideal()` returns a SimResult like kvroute.sim.simulate (router name "ideal");
`fraction_of_ideal()` expresses a run against it: hit rate / ideal hit rate, ideal p90
TTFT / p90 TTFT (1.0 = as fast as the ideal), goodput / ideal goodput when measured.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from typing import Any

from .engine import Engine, EngineConfig, EngineRequest, StepResult
from .fleet import FleetParams, SimResult, _Request, _Run
from .workloads import Workload


class _Counters:
    __slots__ = ("stores", "evictions")

    def __init__(self) -> None:
        self.stores = 0
        self.evictions = 0


class _PooledEngine(Engine):
    """An Engine whose KV block pool (blocks, hashes, free queue, cache) is shared with
    the other engines built on the same `pool` engine."""

    _shared: _Counters

    def __init__(self, config: EngineConfig, pool: _PooledEngine | None = None) -> None:
        self._shared = pool._shared if pool is not None else _Counters()
        super().__init__(config)
        if pool is not None:
            self._ref, self._hash, self._free = pool._ref, pool._hash, pool._free
            self._cached, self._extra = pool._cached, pool._extra

    # The admission memo compares cache versions: they must count every engine's changes.
    @property  # type: ignore[override]
    def _n_stores(self) -> int:
        return self._shared.stores

    @_n_stores.setter
    def _n_stores(self, value: int) -> None:
        self._shared.stores = value

    @property  # type: ignore[override]
    def _n_evictions(self) -> int:
        return self._shared.evictions

    @_n_evictions.setter
    def _n_evictions(self, value: int) -> None:
        self._shared.evictions = value

    def pending_prefill(self) -> int:
        """Prompt tokens not yet computed, of running requests before their first token and
        of waiting requests (as of the end of the step in flight)."""
        return (sum(r.num_tokens - r.computed for r in self._running if r.out == 0)
                + sum(r.num_tokens - r.computed for r in self._waiting))

    def reset_prefix_cache(self) -> bool:
        """Not supported on a shared pool (it would replace the shared hash table)."""
        raise NotImplementedError("the ideal fleet's shared cache is never reset")


class _IdealRun(_Run):
    """The fleet's event loop with pooled engines and a central FIFO queue."""

    def __init__(self, workload: Workload, fleet: FleetParams) -> None:
        super().__init__(workload, fleet, None, False, lambda c, t, now: 0, None)
        n = fleet.replicas
        one = fleet.engine_config(workload.block_tokens)
        cfg = EngineConfig(**{**one.__dict__, "num_kv_blocks": one.num_kv_blocks * n})
        first = _PooledEngine(cfg)
        self.pooled = [first] + [_PooledEngine(cfg, first) for _ in range(n - 1)]
        self.engines = list(self.pooled)
        self.central: deque[tuple[int, _Request]] = deque()

    def _arrive(self, c_idx: int, t_idx: int, now: float) -> None:
        req = _Request(c_idx, t_idx, now)
        self.requests.append(req)
        turn = self.wl.clients[c_idx].turns[t_idx]
        if -(-(turn.prompt_tokens + turn.output_tokens) // self.wl.block_tokens) > self.kv_blocks:
            # Longer than one replica's KV memory: rejected as the fleet rejects it, so
            # both serve the same requests.
            self.rejected += 1
            self._complete(req, now)
            return
        self.central.append((len(self.requests) - 1, req))
        self._dispatch(now)

    def _start_step(self, r: int, now: float) -> StepResult | None:
        eng = self.engines[r]
        # A decode stretch applies its whole effect (blocks freed at its end) at its start:
        # while any replica has a request waiting (for blocks of the shared pool), every
        # replica steps one at a time so the waiting one gets blocks when they are freed.
        waiting = any(e.load()[0] for e in self.engines)
        res = None if waiting else eng.run_decodes(now, self._horizon(now))
        if res is None:
            res = eng.step(now)
        if not res.scheduled and not res.outputs and res.steps == 1:
            # Nothing fits: its waiting head needs blocks other replicas hold in the
            # shared pool. It parks until another replica's step ends (_wake).
            self.busy[r] = False
            return None
        self.busy[r] = True
        heapq.heappush(self.events, (res.end, self._next(), r, res))
        return res

    def _step_end(self, r: int, res: Any, now: float) -> None:
        # Parked replicas first: the pool is as r's ended step left it, before r's next
        # step (whose effects the engine applies when it starts) changes it.
        for other, eng in enumerate(self.engines):
            if other != r and not self.busy[other] and eng.has_work():
                self._start_step(other, now)
        super()._step_end(r, res, now)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        central = self.central
        limit = self.fleet.max_num_seqs
        budget = self.fleet.max_num_batched_tokens
        while central:
            # A replica is idle for prefill while its next step's token budget is not
            # claimed by prompts it has yet to compute: the least claimed takes the head.
            best, best_key = -1, (budget, 0)
            for r, eng in enumerate(self.pooled):
                key = (eng.pending_prefill(), int(self.busy[r]))
                if key < best_key and len(eng._running) < limit:
                    best, best_key = r, key
            if best < 0:
                return
            rid, req = central.popleft()
            req.replica = best
            turn = self.wl.clients[req.client].turns[req.turn]
            self.engines[best].add_request(
                EngineRequest(str(rid), None, turn.output_tokens, req.arrival, block_hashes=turn.after_hashes,
                              num_prompt_tokens=turn.prompt_tokens), now)
            if not self.busy[best]:
                self._start_step(best, now)


def simulate_ideal(workload: Workload, fleet: FleetParams | None = None) -> SimResult:
    """Run `workload` on the ideal fleet of fleet.replicas replicas (module docstring)."""
    fleet = fleet or FleetParams()
    run = _IdealRun(workload, fleet)
    started, cpu_started = time.perf_counter(), time.process_time()
    run.loop()
    rec, m = run.measure()
    return SimResult("ideal", workload.name, m, rec, {}, time.perf_counter() - started,
                     time.process_time() - cpu_started, (run.engines[0].stats(),))


def fraction_of_ideal(result: SimResult, ideal: SimResult) -> dict[str, float]:
    """A run as a fraction of the ideal: hit_rate (its / ideal's), ttft_p90 and
    ttft_mean (ideal's / its: 1.0 = as fast as the ideal), goodput (its / ideal's, when
    the metrics have one); nan when undefined."""
    a, b = result.metrics, ideal.metrics

    def ratio(x: float | None, y: float | None) -> float:
        if x is None or y is None or math.isnan(x) or math.isnan(y) or y == 0:
            return math.nan
        return x / y

    out = {"hit_rate": ratio(a.hit_rate, b.hit_rate), "ttft_p90": ratio(b.ttft_p90, a.ttft_p90),
           "ttft_mean": ratio(b.ttft_mean, a.ttft_mean)}
    if hasattr(a, "goodput"):
        out["goodput"] = ratio(getattr(a, "goodput"), getattr(b, "goodput"))
    return out


def fraction_text(results: list[SimResult], ideal: SimResult) -> str:
    """One line: each router's hit rate and p90 TTFT as fractions of the ideal's."""
    cells = []
    for res in results:
        f = fraction_of_ideal(res, ideal)
        cells.append(f"{res.router} {_pct(f['hit_rate'])} / {_pct(f['ttft_p90'])}")
    return "fraction of the ideal (hit rate / p90 TTFT): " + ", ".join(cells)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


__all__ = ["fraction_of_ideal", "fraction_text", "simulate_ideal"]
