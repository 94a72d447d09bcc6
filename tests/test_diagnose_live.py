"""Diagnostics (the live API a gateway calls) against the batch analysis."""

from __future__ import annotations

import numpy as np
import pytest

import kvroute

from kvroute import sim
from kvroute.diagnose import Diagnostics, mrc, synthetic
from kvroute.diagnose import stream as bs

WL = sim.chat(sim.ChatParams(sessions_per_replica=2, conversations_per_user=2), replicas=2, seed=4)


def test_matches_the_batch_curves_and_finds_the_header():
    prompts, times = synthetic.prompts(WL, synthetic.timestamp_header)
    stream = bs.build([(kvroute.block_hashes(p, 16), len(p), True) for p in prompts], 16)
    diag = Diagnostics(16, cache_tokens=16_384, max_blocks=4096, rate=1.0, volatile_every=1)
    for name in ("a", "b"):
        diag.add_replica(name, now=0.0)
    rep = np.arange(stream.num_ops) % 2
    for i in range(stream.num_ops):
        diag.observe(stream.blocks(i), "ab"[rep[i]], prompt_tokens=int(stream.prompt_tokens[i]),
                     tokens=prompts[i], cached_tokens=0, now=times[i])
    snap = diag.snapshot(sizes=[100, 1024, 10_000])
    batch = mrc.Shards(16, max_blocks=4096).feed(stream).curve([100, 1024, 10_000])
    assert snap["pooled"]["hit_rate"] == [round(float(x), 6) for x in batch.hit_rate]
    split = mrc.per_replica(stream.with_replica(rep), [1024], max_blocks=4096, rate=1.0)
    assert snap["split_at_fleet_cache"] == pytest.approx(float(mrc.fleet_hit_rate(split, [1024])[0]), abs=0.02)
    assert [r["replica"] for r in snap["replicas"]] == ["a", "b"]
    assert sum(r["requests"] for r in snap["replicas"]) == stream.num_ops
    assert snap["volatile"]["found"] and snap["pooled_at_fleet_cache"] < 0.05  # the header defeats the cache


def test_cold_and_warm_ttft():
    t = [0.0]
    diag = Diagnostics(16, cold_window_s=10.0, clock=lambda: t[0])
    diag.add_replica("a")
    h = np.arange(4, dtype=np.uint64)
    diag.observe(h, "a", prompt_tokens=64, request_id=1)
    t[0] = 2.0
    diag.first_token(1, cached_tokens=0)
    t[0] = 20.0
    diag.observe(h, "a", prompt_tokens=64, request_id=2)
    t[0] = 20.5
    diag.first_token(2, cached_tokens=64)
    snap = diag.snapshot()
    assert snap["ttft"]["cold"] == {"samples": 1, "p50": 2.0, "p90": 2.0}
    assert snap["ttft"]["warm"]["p90"] == 0.5
    row = snap["replicas"][0]
    assert row["hit_rate"] == 0.5 and row["joined_s_ago"] == 20.5 and row["requests"] == 2
    diag.first_token(99)  # unknown ids are ignored
    diag.remove_replica("a")
    assert diag.snapshot()["replicas"] == []


def test_bad_input_changes_nothing():
    diag = Diagnostics(16)
    with pytest.raises(ValueError, match="prompt_tokens"):
        diag.observe([1, 2], "a", prompt_tokens=-1)
    with pytest.raises(TypeError, match="replica"):
        diag.observe([1, 2], 3, prompt_tokens=32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hashes"):
        diag.observe([[1]], "a", prompt_tokens=32)
    assert diag.snapshot()["replicas"] == [] and diag.snapshot()["pooled"]["lookups"] == 0
    with pytest.raises(ValueError, match="block_size"):
        Diagnostics(0)
