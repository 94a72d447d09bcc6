"""Scale-out and deploy scenarios: hand-computed runs and the recovery measure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from kvroute import sim
from kvroute.sim.scenarios import Scenario, measure_recovery, simulate_scenario
from kvroute.sim.workloads import Client, Turn, Workload

FLEET1 = sim.FleetParams(replicas=1, cache_tokens=16 * 100, step_fixed_s=0.01, per_token_s=0.001,
                         per_kv_token_s=0.0)


def _turn(base: int, blocks: int = 62) -> Turn:
    chain = np.arange(base, base + blocks, dtype=np.uint64)
    return Turn(chain, blocks * 16 + 8, 1, chain)


def _wl(starts: list[float], base: int = 1000) -> Workload:
    return Workload("hand", 16, tuple(Client(s, (_turn(base),)) for s in starts))


def test_deploy_clears_every_cache_and_the_routers_view():
    wl = _wl([0.0, 10.0])
    kept = simulate_scenario(wl, "ttft", FLEET1, Scenario("deploy", 100.0))
    assert kept.records.cached_tokens.tolist() == [0, 992]
    cleared = simulate_scenario(wl, "ttft", FLEET1, Scenario("deploy", 5.0))
    assert cleared.records.cached_tokens.tolist() == [0, 0]
    # Precise knowledge: the router saw AllBlocksCleared and expected no hit either.
    assert cleared.records.predicted_cached_tokens.tolist() == [0, 0]
    assert cleared.records.ttft.tolist() == pytest.approx([1.01, 1.01])


def test_deploy_resubmits_requests_in_flight():
    # Restarted at 0.5 s in the middle of a 1.01 s prefill: computed again from 0.5 s.
    res = simulate_scenario(_wl([0.0]), "round-robin", FLEET1, Scenario("deploy", 0.5))
    assert res.records.ttft.tolist() == pytest.approx([1.51])
    assert res.metrics.requests == 1 and not math.isnan(res.records.finish[0])


def test_scale_out_adds_cold_replicas_the_router_uses():
    # One replica, then a second at 5 s; round-robin alternates over both afterwards.
    wl = _wl([0.0, 10.0, 20.0, 30.0])
    res = simulate_scenario(wl, "round-robin", FLEET1, Scenario("scale-out", 5.0, add=1))
    assert res.records.replica.tolist() == [0, 1, 0, 1]
    # The new replica's first request misses what replica 0 holds; its second hits its own.
    assert res.records.cached_tokens.tolist() == [0, 0, 992, 992]
    assert len(res.metrics.replica_prefill_s) == 2


def test_measure_recovery_by_hand():
    # 10 s windows from the change at 100 s: baseline 50% before it, then 0%, 20%, 46%.
    arrival = np.array([80.0, 90.0, 100.0, 105.0, 110.0, 120.0, 125.0])
    cached = np.array([50, 50, 0, 0, 20, 45, 47])
    replica = np.array([0, 0, 2, 1, 0, 1, 2])
    rec = SimpleNamespace(arrival=arrival, prompt_tokens=np.full(7, 100), cached_tokens=cached,
                          ttft=np.arange(7, dtype=float), replica=replica)
    res = SimpleNamespace(records=rec)
    sc = Scenario("scale-out", 100.0, add=1)
    r = measure_recovery(res, sc, 2, window_s=10.0, baseline_s=30.0)
    assert r.baseline_hit_rate == 0.5 and r.dip_hit_rate == 0.0
    assert [round(h, 3) for _, h, _ in r.windows] == [0.0, 0.2, 0.46]
    assert r.recovery_s == 30.0  # 46% >= 90% of 50% in the third window
    # First window: 1 of 2 requests on the new replica (2) against a fair share of 1/3.
    assert r.new_share == pytest.approx(1.5) and r.new_ttft_p90 == 2.0 and r.old_ttft_p90 == 3.0
    assert measure_recovery(res, sc, 2, window_s=10.0, baseline_s=30.0, recovered=1.0).recovery_s is None


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "restart", "at_s": 1.0}, "kind"), ({"kind": "deploy", "at_s": -1.0}, "at_s"),
    ({"kind": "scale-out", "at_s": 1.0}, "at least 1"), ({"kind": "deploy", "at_s": 1.0, "add": -1}, "add"),
])
def test_bad_scenarios(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scenario(**kwargs)


def test_cli_scenario_and_ideal(capsys):
    from kvroute import cli

    argv = ["simulate", "--workload", "shared-prefix", "--rate", "40", "--replicas", "2", "--routers",
            "round-robin"]
    assert cli.main(argv + ["--scenario", "deploy@10"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "every replica restarts at 10 s" in out[0] and out[1].startswith("router") and out[2].startswith("round-robin")
    assert cli.main(argv + ["--no-ideal"]) == 0
    assert not any(line.startswith("ideal") for line in capsys.readouterr().out.splitlines())
    assert cli.main(argv) == 0  # the ideal row by default
    out = capsys.readouterr().out.splitlines()
    assert out[4].startswith("ideal") and out[5].startswith("fraction of the ideal (hit rate / p90 TTFT): round-robin")
    assert cli.main(argv + ["--scenario", "deploy"]) == 2
    assert "--scenario must look like" in capsys.readouterr().err


def test_slow_start_ramps_new_replicas_in():
    # least-loaded sends the idle newcomer everything at first; with a 40 s slow start it
    # is eligible for about (t - 5) / 40 of the decisions, then for all of them.
    wl = _wl([0.0] + [6.0 + 2 * i for i in range(30)])
    sc = Scenario("scale-out", 5.0, add=1)
    burst = simulate_scenario(wl, "least-loaded", FLEET1, sc)
    slow = simulate_scenario(wl, "least-loaded", FLEET1, sc, slow_start_s=40.0)
    early = (burst.records.arrival > 5.0) & (burst.records.arrival < 25.0)
    assert burst.records.replica[early].mean() > 0.4
    assert slow.records.replica[early].mean() < burst.records.replica[early].mean()
    late = slow.records.arrival > 45.0
    assert 0 < slow.records.replica[late].mean() < 1  # eligible for every decision again
    with pytest.raises(ValueError, match="slow_start_s"):
        simulate_scenario(wl, "least-loaded", FLEET1, sc, slow_start_s=-1.0)
