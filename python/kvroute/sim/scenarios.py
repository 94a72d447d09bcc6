"""Scale-out and deploy: what happens to the hit rate when the fleet changes mid-run.

The seed's failure modes: "hit rate collapses to near zero right after a deploy" and
"latency gets worse immediately after scaling out: the new replicas have cold caches,
and a load-weighted router preferentially sends them traffic precisely because they are
idle". Both run on the fleet model (kvroute.sim.fleet) with one change at `at_s`:

- scale-out: `add` fresh replicas (empty caches) join; the router learns them through
  Router.add_replica, as a gateway's discovery would add them.
- deploy: every replica restarts: its engine is replaced by an empty one, and the
  requests it held are re-submitted to it (prompts recomputed; a request that already
  streamed its first token keeps its TTFT, the rest of its answer is regenerated). With
  precise or hybrid knowledge the router sees AllBlocksCleared for each replica (the
  engines' publishers restart); an approximate router is told nothing.

measure_recovery() cuts the run into windows of window_s seconds of arrivals: the
baseline is the hit rate (cached input tokens / input tokens) of the requests arriving in
the `baseline_s` before the change, and the recovery time is the end of the first window
after it whose hit rate is back to `recovered` (90%) of the baseline (None: never in the
run). For scale-out it also reports the new replicas' share of the requests in the first
window (against their share of the fleet: a burst to cold replicas shows as > 1) and
their p90 TTFT against the old replicas' in the same window.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .engine import Engine, EngineRequest, StepResult
from .fleet import FleetParams, SimResult, _Run, make_router
from .kv_events import AllBlocksCleared
from .routers import RouterSpec, router_spec
from .workloads import Workload

KINDS = ("scale-out", "deploy")


@dataclass(frozen=True)
class Scenario:
    """kind: "scale-out" or "deploy". at_s: when (seconds). add: replicas a scale-out adds."""

    kind: str
    at_s: float
    add: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.at_s, (int, float)) or not math.isfinite(self.at_s) or self.at_s < 0:
            raise ValueError(f"at_s must be a finite number >= 0, got {self.at_s!r}")
        if isinstance(self.add, bool) or not isinstance(self.add, int) or self.add < 0:
            raise ValueError(f"add must be an int >= 0, got {self.add!r}")
        if self.kind == "scale-out" and self.add < 1:
            raise ValueError("a scale-out adds at least 1 replica (add >= 1)")


@dataclass(frozen=True)
class Recovery:
    """What a scenario did to the run (see measure_recovery)."""

    baseline_hit_rate: float
    dip_hit_rate: float
    recovery_s: float | None
    windows: list[tuple[float, float, float]] = field(default_factory=list)  # (start, hit rate, p90 TTFT)
    new_share: float | None = None
    new_ttft_p90: float | None = None
    old_ttft_p90: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Action:
    __slots__ = ()


class _ScenarioRun(_Run):
    def __init__(self, workload: Workload, fleet: FleetParams, router: Any, sessions: bool,
                 scenario: Scenario, slow_start_s: float = 0.0) -> None:
        super().__init__(workload, fleet, router, sessions, None, None)
        self.scenario = scenario
        self.slow_start_s = float(slow_start_s)
        self.joined: dict[str, float] = {}
        self.rng = np.random.default_rng([fleet.seed, 7])
        self.current: list[Any] = [None] * len(self.engines)
        self.config = fleet.engine_config(workload.block_tokens)
        import heapq

        heapq.heappush(self.events, (float(scenario.at_s), self._next(), 0, _Action()))

    def _start_step(self, r: int, now: float) -> StepResult | None:
        self.current[r] = res = super()._start_step(r, now)
        return res

    def _step_end(self, r: int, res: Any, now: float) -> None:
        if isinstance(res, _Action):
            self._act(now)
            return
        if res is not self.current[r]:
            return  # a step of an engine replaced by a restart
        self.current[r] = None
        if any(o.is_first_token and not math.isnan(self.requests[int(o.request_id)].ttft) for o in res.outputs):
            # Re-submitted after a restart: its first token (TTFT, cached, prefill_done)
            # was earlier; this one is only the first of its regenerated rest.
            res = replace(res, outputs=[replace(o, is_first_token=False)
                                        if o.is_first_token and not math.isnan(self.requests[int(o.request_id)].ttft)
                                        else o for o in res.outputs])
        super()._step_end(r, res, now)

    def _arrive(self, c_idx: int, t_idx: int, now: float) -> None:
        # Slow start: a new replica is eligible for a share of decisions that ramps from 0
        # to 1 over slow_start_s (drained for the others), as a weight ramping in would.
        for name, joined in list(self.joined.items()):
            weight = (now - joined) / self.slow_start_s
            if weight >= 1.0:
                self.router.drain(name, False)
                del self.joined[name]
            else:
                self.router.drain(name, bool(self.rng.random() >= weight))
        super()._arrive(c_idx, t_idx, now)

    def _act(self, now: float) -> None:
        if self.scenario.kind == "scale-out":
            for _ in range(self.scenario.add):
                r = len(self.engines)
                name = f"replica-{r}"
                self.engines.append(Engine(self.config))
                self.names.append(name)
                self.busy.append(False)
                self.current.append(None)
                if self.knowledge is not None:
                    self.knowledge.copies.append({})
                if self.router is not None and self.router.add_replica(name) != r:
                    raise RuntimeError("the router did not give the new replica the next dense id")
                if self.slow_start_s > 0:
                    self.joined[name] = now
            return
        for r in range(len(self.engines)):
            self._restart(r, now)

    def _restart(self, r: int, now: float) -> None:
        old = self.engines[r]
        # The engine's state is its in-flight step's end: what that step produced (tokens,
        # even whole requests that finished in it) was never seen, so it is redone.
        unseen = {} if self.current[r] is None else {o.request_id: o for o in self.current[r].outputs}
        running, waiting = old.request_ids()
        ids = running + waiting + [rid for rid, o in unseen.items() if o.finished]
        new = self.engines[r] = Engine(self.config)
        self.busy[r] = False
        self.current[r] = None
        if self.knowledge is not None:
            self.knowledge.apply(r, [AllBlocksCleared()], now)
        for rid in ids:
            req = self.requests[int(rid)]
            turn = self.wl.clients[req.client].turns[req.turn]
            o = unseen.get(rid)
            done = turn.output_tokens if o is not None and o.finished else old.progress(rid)[2]
            left = turn.output_tokens - (done - (o.num_new_tokens if o is not None else 0))
            new.add_request(EngineRequest(rid, None, max(left, 1), now, block_hashes=turn.after_hashes,
                                          num_prompt_tokens=turn.prompt_tokens), now)
        if new.has_work():
            self._start_step(r, now)


def simulate_scenario(workload: Workload, router: Any, fleet: FleetParams, scenario: Scenario, *,
                      sessions: bool | None = None, slow_start_s: float = 0.0) -> SimResult:
    """Run `workload` on `fleet` (its replicas are the fleet before the change) under
    `router` (a name, RouterSpec or RouterConfig) with the scenario's change at at_s.

    slow_start_s > 0 (scale-out): each new replica is eligible for a fraction of the
    decisions that ramps linearly from 0 to 1 over that many seconds after it joins
    (emulated with Router.drain per decision: the router itself has no slow start)."""
    if not isinstance(slow_start_s, (int, float)) or not math.isfinite(slow_start_s) or slow_start_s < 0:
        raise ValueError(f"slow_start_s must be a finite number >= 0, got {slow_start_s!r}")
    name = ""
    if isinstance(router, str):
        router = router_spec(router)
    if isinstance(router, RouterSpec):
        name = router.name
        if sessions is None:
            sessions = router.sessions
        router = router.config()
    name = name or getattr(router, "policy", "")
    rt = make_router(router, fleet, workload.block_tokens)
    run = _ScenarioRun(workload, fleet, rt, True if sessions is None else bool(sessions), scenario, slow_start_s)
    started, cpu_started = time.perf_counter(), time.process_time()
    run.loop()
    rec, m = run.measure()
    return SimResult(name, workload.name, m, rec, dict(rt.stats()), time.perf_counter() - started,
                     time.process_time() - cpu_started, tuple(e.stats() for e in run.engines))


def measure_recovery(result: SimResult, scenario: Scenario, old_replicas: int, *, window_s: float = 60.0,
                     baseline_s: float = 120.0, recovered: float = 0.9) -> Recovery:
    """Baseline, dip and recovery time of the hit rate around the scenario's change (see
    the module docstring)."""
    rec = result.records
    at = float(scenario.at_s)
    served = ~np.isnan(rec.ttft)  # requests longer than a replica's KV memory are rejected
    before = served & (rec.arrival >= at - baseline_s) & (rec.arrival < at)
    base = _hit(rec, before)
    windows = []
    recovery = None
    end = float(rec.arrival.max()) if rec.arrival.size else at
    k = 0
    while at + k * window_s <= end:
        lo = at + k * window_s
        m = served & (rec.arrival >= lo) & (rec.arrival < lo + window_s)
        hit = _hit(rec, m)
        windows.append((lo, hit, _p90(rec.ttft[m])))
        if recovery is None and not math.isnan(hit) and not math.isnan(base) and hit >= recovered * base:
            recovery = (k + 1) * window_s
        k += 1
    dips = [h for _, h, _ in windows if not math.isnan(h)]
    out = Recovery(base, min(dips) if dips else math.nan, recovery, windows)
    if scenario.kind == "scale-out":
        first = served & (rec.arrival >= at) & (rec.arrival < at + window_s)
        new = first & (rec.replica >= old_replicas)
        fair = scenario.add / (old_replicas + scenario.add)
        share = (new.sum() / first.sum() / fair) if first.any() else math.nan
        out = Recovery(base, out.dip_hit_rate, recovery, windows, float(share), _p90(rec.ttft[new]),
                       _p90(rec.ttft[first & ~new]))
    return out


def parse(text: str) -> Scenario:
    """'deploy@300' or 'scale-out@300+2' (kind@seconds[+replicas added])."""
    try:
        kind, rest = text.split("@", 1)
        at, _, add = rest.partition("+")
        return Scenario(kind, float(at), int(add) if add else 0)
    except ValueError as exc:
        raise ValueError(f"--scenario must look like deploy@300 or scale-out@300+2 ({exc})") from None


RECOVERY_COLUMNS = ("router", "hit before", "lowest window", "recovered after", "hit rate", "p90 TTFT",
                    "new replicas' share", "p90 TTFT new / old")


def recovery_rows(results: list[tuple[SimResult, Recovery]]) -> list[list[str]]:
    """One row of formatted cells per router, in RECOVERY_COLUMNS order."""
    def pct(x: float) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:.1%}"

    def sec(x: float | None) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:.2f} s"

    out = []
    for res, r in results:
        out.append([res.router, pct(r.baseline_hit_rate), pct(r.dip_hit_rate),
                    "never" if r.recovery_s is None else f"{r.recovery_s:.0f} s", pct(res.metrics.hit_rate),
                    sec(res.metrics.ttft_p90), "-" if r.new_share is None else f"{r.new_share:.2f}x",
                    "-" if r.new_ttft_p90 is None else f"{sec(r.new_ttft_p90)} / {sec(r.old_ttft_p90)}"])
    return out


def recovery_markdown(results: list[tuple[SimResult, Recovery]]) -> str:
    """The recovery table in Markdown."""
    lines = ["| " + " | ".join(RECOVERY_COLUMNS) + " |", "|" + "---|" * len(RECOVERY_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in recovery_rows(results)])


def recovery_text(results: list[tuple[SimResult, Recovery]]) -> str:
    """The recovery table as aligned plain text."""
    body = [list(RECOVERY_COLUMNS)] + recovery_rows(results)
    widths = [max(len(r[i]) for r in body) for i in range(len(RECOVERY_COLUMNS))]
    return "\n".join("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip()
                     for r in body)


def _hit(rec: Any, mask: np.ndarray) -> float:
    tokens = int(rec.prompt_tokens[mask].sum())
    return float(rec.cached_tokens[mask].sum()) / tokens if tokens else math.nan


def _p90(values: np.ndarray) -> float:
    return float(np.percentile(values, 90)) if values.size else math.nan


__all__ = ["KINDS", "RECOVERY_COLUMNS", "Recovery", "Scenario", "measure_recovery", "parse", "recovery_markdown",
           "recovery_rows", "recovery_text", "simulate_scenario"]
