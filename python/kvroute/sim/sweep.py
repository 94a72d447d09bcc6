"""Goodput: the highest arrival rate at which a router keeps p90 TTFT within an SLO.

A sweep runs the same workload at several arrival-rate factors (Workload.scaled: arrival
and think times divided by the factor) and measures p90 TTFT at each. The search:

1. a ladder from `start`: if the start meets the SLO, multiply the factor by `step`
   (default 2) until a run misses it; otherwise divide until one meets it (at most
   `max_ladder` runs either way);
2. geometric bisection between the highest factor that met the SLO and the lowest above
   it that missed, until the missed factor is within `tol` (default 1%) of the met one:
   goodput's factor is resolved to 1% (7 bisections after a ladder step of 2), so two
   routers reported at the same factor are within 1% of each other's rate.

goodput = the measured arrival rate (requests/s over the run, Metrics.arrival_rate) of
the highest factor that met the SLO; 0 when even the lowest missed. p90 TTFT need not be
monotone in the rate; the search reports the crossing it found, and every point it ran
(SweepResult.points) so a plot shows the whole curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .fleet import FleetParams, SimResult, simulate
from .routers import RouterSpec, router_spec
from .workloads import Workload

#: The default TTFT SLO (seconds) and the percentile it applies to.
DEFAULT_SLO = 2.0
QUANTILE = 90


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: the rate factor, the measured arrival rate, p90 TTFT, whether
    it met the SLO, and the run itself."""

    scale: float
    arrival_rate: float
    ttft_p90: float
    ok: bool
    result: SimResult


@dataclass(frozen=True)
class SweepResult:
    """A router's sweep: goodput (requests/s) and the factor it was reached at (0 and 0.0
    when no run met the SLO), the SLO, and every point run, by factor."""

    router: str
    workload: str
    slo: float
    goodput: float
    goodput_scale: float
    points: tuple[SweepPoint, ...]

    def at(self, scale: float) -> SweepPoint | None:
        """The point run at this factor, if any."""
        return next((p for p in self.points if math.isclose(p.scale, scale)), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: goodput and each point's factor, rate, p90 and hit rate."""
        return {"router": self.router, "workload": self.workload, "slo": self.slo, "goodput": self.goodput,
                "goodput_scale": self.goodput_scale,
                "points": [{"scale": p.scale, "arrival_rate": p.arrival_rate, "ttft_p90": p.ttft_p90, "ok": p.ok,
                            "hit_rate": p.result.metrics.hit_rate} for p in self.points]}


def sweep(
    workload: Workload,
    router: str | RouterSpec,
    fleet: FleetParams | None = None,
    *,
    slo: float = DEFAULT_SLO,
    start: float = 1.0,
    step: float = 2.0,
    tol: float = 0.01,
    max_ladder: int = 6,
    impl: Any = None,
    progress: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """Find a router's goodput on `workload` (see the module docstring)."""
    _check(slo, start, step, tol)
    spec = router if isinstance(router, RouterSpec) else router_spec(router)
    return search(lambda wl: simulate(wl, spec, fleet, impl=impl), spec.name, workload, slo=slo, start=start,
                  step=step, tol=tol, max_ladder=max_ladder, progress=progress)


def search(
    run_one: Callable[[Workload], SimResult],
    name: str,
    workload: Workload,
    *,
    slo: float = DEFAULT_SLO,
    start: float = 1.0,
    step: float = 2.0,
    tol: float = 0.01,
    max_ladder: int = 6,
    progress: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """sweep() for any fleet: run_one(workload scaled) -> its SimResult (e.g. the ideal
    fleet, kvroute.sim.ideal.sweep_ideal); name labels the result."""
    _check(slo, start, step, tol)
    points: dict[float, SweepPoint] = {}

    def run(scale: float) -> SweepPoint:
        res = run_one(workload.scaled(scale))
        m = res.metrics
        pt = SweepPoint(scale, m.arrival_rate, m.ttft_p90, bool(m.ttft_p90 <= slo), res)
        points[scale] = pt
        if progress is not None:
            progress(pt)
        return pt

    good = search_factor(lambda s: run(s).ok, start, step, tol, max_ladder)
    best = points[good] if good is not None else None
    return SweepResult(name, workload.name, float(slo), best.arrival_rate if best else 0.0,
                       good or 0.0, tuple(points[k] for k in sorted(points)))


def _check(slo: float, start: float, step: float, tol: float) -> None:
    if not (isinstance(slo, (int, float)) and math.isfinite(slo) and slo > 0):
        raise ValueError(f"slo must be a finite number of seconds > 0, got {slo!r}")
    if not (math.isfinite(start) and start > 0 and math.isfinite(step) and step > 1):
        raise ValueError(f"start must be > 0 and step > 1, got start={start!r}, step={step!r}")
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and 0 < tol < step - 1):
        raise ValueError(f"tol must be > 0 and below step - 1, got tol={tol!r}")


def search_factor(ok: Callable[[float], bool], start: float, step: float = 2.0, tol: float = 0.01,
                  max_ladder: int = 6) -> float | None:
    """The highest factor found with ok(factor) true (None: none of the ladder's): the
    ladder, then bisection until the lowest factor above it that failed is within
    (1 + tol) of it (module docstring). When the ladder never fails (max_ladder steps up),
    its last factor is returned unresolved."""
    good, bad = _ladder(ok, start, step, max_ladder)
    if good is None or bad is None:
        return good
    while bad > good * (1.0 + tol):
        mid = math.sqrt(good * bad)
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def _ladder(ok: Callable[[float], bool], start: float, step: float,
            max_ladder: int) -> tuple[float | None, float | None]:
    """(highest factor that met the SLO, lowest above it that missed); None: not found."""
    scale = start
    first = ok(scale)
    for _ in range(max_ladder):
        nxt = scale * step if first else scale / step
        if ok(nxt) != first:
            return (scale, nxt) if first else (nxt, scale)
        scale = nxt
    return (scale, None) if first else (None, scale)


__all__ = ["DEFAULT_SLO", "QUANTILE", "SweepPoint", "SweepResult", "search", "search_factor", "sweep"]
