"""Goodput search (kvroute.sim.sweep): the ladder, the bisection to its tolerance, and a
real sweep whose reported factor met the SLO with a missed factor within the tolerance."""

from __future__ import annotations

import math

import pytest

from kvroute import sim
from kvroute.sim.sweep import search_factor as search
from kvroute.sim.workloads import SharedPrefixParams, shared_prefix


def _threshold(limit: float, calls: list[float]):
    def ok(x: float) -> bool:
        calls.append(x)
        return x <= limit
    return ok


@pytest.mark.parametrize("limit", [0.3, 1.0, 3.7, 9.99, 15.5])
@pytest.mark.parametrize("tol", [0.05, 0.01, 0.001])
def test_search_brackets_the_threshold_within_tol(limit, tol):
    calls: list[float] = []
    good = search(_threshold(limit, calls), 1.0, 2.0, tol)
    assert good is not None and good <= limit
    failed_above = [x for x in calls if x > good]
    # the lowest factor above it that was run failed, and lies within (1 + tol)
    assert failed_above and min(failed_above) <= good * (1 + tol) * (1 + 1e-12)
    assert min(failed_above) > limit
    # bisection: the calls after the ladder are about log2(log(step) / log(1 + tol))
    assert len(calls) <= 2 + math.ceil(math.log2(limit + 2)) + math.ceil(math.log2(math.log(2) / math.log1p(tol))) + 1


def test_search_without_a_crossing():
    assert search(lambda x: True, 1.0, 2.0, 0.01, max_ladder=3) == 8.0  # ladder end, unresolved
    assert search(lambda x: False, 1.0, 2.0, 0.01, max_ladder=3) is None


def test_sweep_rejects_a_bad_tolerance():
    wl = shared_prefix(SharedPrefixParams(groups=2, prompts_per_group=2, rate=4.0), 0)
    for tol in (0.0, -0.1, float("nan"), 1.0):
        with pytest.raises(ValueError, match="tol"):
            sim.sweep(wl, "round-robin", sim.FleetParams(replicas=2), tol=tol)


def test_sweep_reports_a_factor_that_met_and_a_miss_within_tol():
    wl = shared_prefix(SharedPrefixParams(groups=4, prompts_per_group=8, system_tokens=1024, output_tokens=32,
                                          rate=8.0), 0)
    sw = sim.sweep(wl, "round-robin", sim.FleetParams(replicas=2), slo=0.5, tol=0.02)
    best = sw.at(sw.goodput_scale)
    assert best is not None and best.ok and best.ttft_p90 <= 0.5
    assert sw.goodput == best.arrival_rate > 0
    above = [p for p in sw.points if p.scale > sw.goodput_scale]
    assert above and not min(above, key=lambda p: p.scale).ok
    assert min(p.scale for p in above) <= sw.goodput_scale * 1.02 * (1 + 1e-12)
    for p in sw.points:
        assert p.ok == (p.ttft_p90 <= 0.5)
