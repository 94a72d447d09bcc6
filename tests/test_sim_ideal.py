"""The ideal fleet (one shared cache, one central queue) on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute import sim
from kvroute.sim.ideal import fraction_of_ideal, simulate_ideal
from kvroute.sim.workloads import Client, Turn, Workload

# 1,000 tokens/s, no overhead, 10 ms per output token: every time below is exact.
FLEET = sim.FleetParams(replicas=2, cache_tokens=16 * 100, prefill_rate=1000.0, prefill_overhead=0.0,
                        time_per_output_token=0.01)


def _turn(base: int, blocks: int = 62, extra: int = 8, output: int = 10, think: float = 0.0,
          first: bool = True) -> Turn:
    chain = np.arange(base, base + blocks + 1, dtype=np.uint64)
    return Turn(chain[:blocks], blocks * 16 + extra, output, chain[:blocks], think, None, first)


def _wl(clients: list[Client]) -> Workload:
    return Workload("hand", 16, tuple(clients))


def test_central_queue_and_shared_cache():
    # Three prompts of 1,000 tokens at t=0 on two replicas; the third repeats the first.
    wl = _wl([Client(0.0, (_turn(1000),)), Client(0.0, (_turn(5000),)), Client(0.0, (_turn(1000),))])
    res = simulate_ideal(wl, FLEET)
    rec = res.records
    assert rec.replica.tolist() == [0, 1, 0]
    # The third waits for the first replica to free at t=1 s, then hits 62 blocks (992
    # tokens) the first stored at its first token: 8 tokens of prefill.
    assert rec.cached_tokens.tolist() == [0, 0, 992]
    assert rec.ttft.tolist() == pytest.approx([1.0, 1.0, 1.008])
    assert res.metrics.hit_rate == pytest.approx(992 / 3000)


def test_cache_is_the_fleets_total():
    # 2 replicas x 100 blocks = 200 blocks shared: three chains of 62 blocks fit together
    # (186), so the second turn of each conversation hits its whole history.
    clients = [Client(i * 10.0, (_turn(10_000 * (i + 1)), _turn(10_000 * (i + 1), think=50.0, first=False)))
               for i in range(3)]
    res = simulate_ideal(_wl(clients), FLEET)
    assert res.metrics.cached_tokens == 3 * 992
    # Per replica (100 blocks) a router could keep at most one 62-block chain per replica.
    routed = sim.simulate(_wl(clients), "round-robin", FLEET)
    assert routed.metrics.cached_tokens < res.metrics.cached_tokens


def test_idle_replica_takes_next_no_waiting_while_idle():
    # Two arrivals 0.5 s apart on two replicas: the second never waits.
    wl = _wl([Client(0.0, (_turn(1000),)), Client(0.5, (_turn(2000),))])
    res = simulate_ideal(wl, FLEET)
    assert res.records.ttft.tolist() == pytest.approx([1.0, 1.0])
    assert res.records.replica.tolist() == [0, 1]


def test_fraction_of_ideal():
    wl = _wl([Client(0.0, (_turn(1000),)), Client(0.0, (_turn(5000),)), Client(0.0, (_turn(1000),))])
    ideal = simulate_ideal(wl, FLEET)
    rr = sim.simulate(wl, "round-robin", FLEET)
    # Round-robin puts the repeat on replica 0 behind the first: it waits 1 s and hits.
    assert rr.records.replica.tolist() == [0, 1, 0]
    frac = fraction_of_ideal(rr, ideal)
    assert frac["hit_rate"] == pytest.approx(1.0)
    assert frac["ttft_p90"] == pytest.approx(ideal.metrics.ttft_p90 / rr.metrics.ttft_p90)
    one = sim.FleetParams(**{**FLEET.__dict__, "replicas": 1})
    assert fraction_of_ideal(sim.simulate(wl, "round-robin", one), ideal)["ttft_p90"] < 1.0


def test_ideal_on_chat_at_the_default_cache():
    wl = sim.chat(sim.ChatParams(sessions_per_replica=4, conversations_per_user=2), replicas=4, seed=2)
    fleet = sim.FleetParams(replicas=4)
    ideal = simulate_ideal(wl, fleet)
    assert ideal.metrics.requests == wl.num_requests
    # Every live conversation's history fits the pooled cache (4 x 163,840 tokens): first
    # turns miss, and each later turn hits exactly its previous turn's prompt + answer.
    rec = ideal.records
    assert rec.cached_tokens[rec.first].sum() == 0
    later = ~rec.first
    expected = [len(wl.clients[c].turns[k - 1].after_hashes) * 16 for c, k in zip(rec.client[later], rec.turn[later])]
    assert later.sum() > 50 and rec.cached_tokens[later].tolist() == expected
    for router in ("round-robin", "ttft"):
        frac = fraction_of_ideal(sim.simulate(wl, router, fleet), ideal)
        assert 0.0 < frac["hit_rate"] <= 1.0 + 1e-9
