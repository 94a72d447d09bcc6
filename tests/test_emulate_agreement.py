"""Simulator and emulator agree: the same workload and router through `kvroute simulate`'s
fleet model and through emulated engines (real time, scaled) behind a kvroute Router in a
minimal proxy, replayed over HTTP by kvroute.bench. Acceptance: hit rates within 3 points,
median TTFT within 20%. docs/results.md ("Simulator vs emulator") records a larger run
(scripts/emulate_agreement.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("aiohttp")
pytest.importorskip("zmq")

from emulate_proxy import emulated_run  # noqa: E402

from kvroute import sim  # noqa: E402

TIME_SCALE = 0.5  # wall seconds per engine second


@pytest.mark.slow
def test_sim_and_emulator_agree_on_shared_prefix():
    wl = sim.shared_prefix(sim.SharedPrefixParams(groups=8, prompts_per_group=8, system_tokens=1024,
                                                  question_tokens=128, output_tokens=32, rate=6.0), seed=1)
    fleet = sim.FleetParams(replicas=4, cache_tokens=65_536, knowledge="precise")
    spec = sim.router_spec("ttft")
    simulated = sim.simulate(wl, spec, fleet).metrics
    emulated = emulated_run(wl, spec, fleet, TIME_SCALE)
    assert emulated["errors"] == 0 and emulated["requests"] == wl.num_requests
    assert abs(emulated["hit_rate"] - simulated.hit_rate) <= 0.03, (emulated, simulated)
    assert abs(emulated["ttft_p50"] / simulated.ttft_p50 - 1.0) <= 0.20, (emulated, simulated)
