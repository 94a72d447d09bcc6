"""Simulator benchmarks: whole simulated runs, native and reference routers in one group.

The target (issue 12, with the vLLM-like engine model per replica): the Mooncake
conversation trace (12,031 requests) on 8 replicas in <= 30 s per router with the native
router (the `full trace` groups, native only: the reference takes minutes). The shared groups run the first 3,000 requests with both
implementations, and check that both give the same run.

Run: python -m pytest benchmarks/bench_sim.py --benchmark-only
     python benchmarks/report.py benchmarks/bench_sim.py   (medians and ratios)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvroute._native as native
import kvroute.reference as reference
from kvroute import sim

IMPLS = {"native": native, "reference": reference}
TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is not checked out")

_RUNS: dict[tuple[str, int], sim.SimResult] = {}


def _check(res: sim.SimResult, wl: sim.Workload, key: tuple[str, int]) -> None:
    m = res.metrics
    assert m.requests == wl.num_requests
    assert 0.0 <= m.hit_rate <= 0.375  # an infinite cache reaches 37.3% on the whole trace
    assert m.fleet_prefill_s == pytest.approx(float(res.records.prefill_s.sum()))
    assert m.throughput_tok_s > 0 and m.tpot_mean > 0
    # Both implementations must simulate the same run, decision for decision.
    first = _RUNS.setdefault(key, res)
    assert first.records.replica.tolist() == res.records.replica.tolist()
    assert first.metrics == m


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("router", ["round-robin", "cache-aware", "ttft"])
def test_trace_3000(benchmark, impl, router):
    """The first 3,000 trace requests on 8 replicas."""
    benchmark.group = f"sim: trace, first 3,000 requests, 8 replicas, {router}"
    wl = sim.trace(TRACE, sim.TraceParams(limit=3000))
    fleet = sim.fleet_for("trace")
    res = benchmark.pedantic(sim.simulate, args=(wl, router, fleet), kwargs={"impl": IMPLS[impl]},
                             rounds=1 if impl == "reference" else 3, iterations=1)
    _check(res, wl, (router, 3000))


@pytest.mark.parametrize("router", ["round-robin", "sticky", "cache-aware", "ttft", "dynamo"])
def test_full_trace_native(benchmark, router):
    """The whole conversation trace (12,031 requests): the <= 30 s per router target."""
    benchmark.group = f"sim: full trace, 12,031 requests, 8 replicas, {router}"
    wl = sim.trace(TRACE)
    fleet = sim.fleet_for("trace")
    res = benchmark.pedantic(sim.simulate, args=(wl, router, fleet), kwargs={"impl": native}, rounds=1,
                             iterations=1)
    _check(res, wl, (router, 12031))
