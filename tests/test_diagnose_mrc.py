"""Miss-ratio curves: exact at sampling rate 1, within 2 points of exact LRU when sampled."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute import sim
from kvroute.diagnose import mrc
from kvroute.diagnose import stream as bs

TRACE = Path(os.environ.get("KVROUTE_TRACE", Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
                            / "conversation_trace.jsonl"))


def _naive(ops: list[tuple[list[int], int, bool]], capacity: int, bt: int) -> float:
    """A dict-based prefix cache: longest cached prefix, then refresh deepest first, evict LRU."""
    lru: OrderedDict[int, None] = OrderedDict()
    cached = total = 0
    for hashes, tokens, counted in ops:
        if counted:
            hit = 0
            while hit < len(hashes) and hashes[hit] in lru:
                hit += 1
            cached += min(hit * bt, tokens)
            total += tokens
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return cached / total if total else 0.0


# Prompts are paths in a small random tree: a block's hash names its whole prefix.
paths = st.lists(st.integers(0, 2), min_size=0, max_size=7)
op_lists = st.lists(st.tuples(paths, st.integers(0, 20), st.booleans()), min_size=1, max_size=40)


def _ops(raw: list[tuple[list[int], int, bool]], bt: int) -> list[tuple[list[int], int, bool]]:
    out = []
    for path, extra, counted in raw:
        hashes = [hash(tuple(path[: i + 1])) & ((1 << 64) - 1) for i in range(len(path))]
        out.append((hashes, len(hashes) * bt + extra if counted else 0, counted or not hashes))
    return out


@given(op_lists, st.integers(1, 12))
def test_rate_one_is_exact_lru_prefix_cache(raw, capacity):
    ops = _ops(raw, 4)
    stream = bs.build([(np.array(h, dtype=np.uint64), t, c) for h, t, c in ops], 4)
    curve = mrc.Shards(4, rate=1.0, max_blocks=1000).feed(stream).curve([capacity])
    assert curve.hit_rate[0] == pytest.approx(_naive(ops, capacity, 4), abs=1e-12)


@given(op_lists, st.sampled_from([1.0, 0.5, 0.05]), st.integers(1, 12))
def test_adding_one_operation_at_a_time_equals_feeding_the_stream(raw, rate, max_blocks):
    """Shards.add (the gateway's per-request path) is feed_arrays for one operation: the same
    histogram, counters, sampling threshold and tracked set, through shrinks and compactions."""
    ops = _ops(raw, 4)
    stream = bs.build([(np.array(h, dtype=np.uint64), t, c) for h, t, c in ops], 4)
    whole = mrc.Shards(4, rate=rate, max_blocks=max_blocks).feed(stream)
    one = mrc.Shards(4, rate=rate, max_blocks=max_blocks)
    for h, t, c in ops:
        one.add(np.array(h, dtype=np.uint64), t, c)
    sizes = [1, 2, 3, 5, 8, 13, 40]
    assert one.hit_blocks(sizes).tolist() == whole.hit_blocks(sizes).tolist()
    assert (one.blocks, one.lookups, one.input_tokens, one.rate, one.tracked) == (
        whole.blocks, whole.lookups, whole.input_tokens, whole.rate, whole.tracked)


def test_rate_one_matches_the_simulators_cache_on_chat():
    wl = sim.chat(sim.ChatParams(sessions_per_replica=4, conversations_per_user=2), replicas=2, seed=3)
    stream = bs.from_workload(wl)
    sizes = mrc.default_sizes(len(np.unique(stream.hashes)), 8)
    exact = mrc.exact_hit_rate(stream, sizes)
    est = mrc.Shards(16, rate=1.0, max_blocks=10**6).feed(stream).curve(sizes)
    assert np.abs(est.hit_rate - exact).max() < 1e-9
    assert exact[-1] > 0.5  # the check is not vacuous: history is reused


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is not checked out")
def test_conversation_trace_within_two_points():
    stream = bs.read_jsonl(TRACE).stream
    sizes = mrc.default_sizes(len(np.unique(stream.hashes)), 8)
    curve = mrc.estimate(stream, sizes)  # fixed-size SHARDS: 65,536 blocks tracked
    assert curve.rate < 0.5 and curve.tracked <= 65_536
    exact = mrc.exact_hit_rate(stream, sizes)
    assert np.abs(curve.hit_rate - exact).max() < 0.02
    assert exact.max() == pytest.approx(0.373, abs=0.002)  # the README's infinite-cache rate


def test_chat_within_two_points_sampled():
    stream = bs.from_workload(sim.chat(replicas=2, seed=1))
    sizes = mrc.default_sizes(len(np.unique(stream.hashes)), 8)
    curve = mrc.estimate(stream, sizes, rate=0.1, max_blocks=32_768)
    exact = mrc.exact_hit_rate(stream, sizes)
    assert curve.rate <= 0.1
    assert np.abs(curve.hit_rate - exact).max() < 0.02
    assert exact.max() > 0.5


def test_memory_is_bounded_and_rate_falls():
    rng = np.random.default_rng(0)
    ops = [(rng.integers(0, 1 << 63, 50, dtype=np.uint64), 50 * 16, True) for _ in range(400)]
    est = mrc.Shards(16, max_blocks=1000).feed(bs.build(ops, 16))
    assert est.tracked <= 1000
    assert est.rate < 1000 / 20_000 * 1.2  # about max_blocks / distinct blocks
    assert est.curve([10**6]).hit_rate[0] == pytest.approx(0.0, abs=0.02)  # nothing repeats


def test_per_replica_and_fleet():
    wl = sim.chat(sim.ChatParams(sessions_per_replica=4, conversations_per_user=2), replicas=2, seed=0)
    stream = bs.from_workload(wl)
    # Conversations split by parity of their first block: each replica sees whole sessions.
    rep = (stream.hashes[stream.offsets[:-1]] % np.uint64(2)).astype(np.int64)
    split = stream.with_replica(rep)
    sizes = [500, 2000, 4000]  # exact bins below 4,096 blocks; 0.1% wide above
    curves = mrc.per_replica(split, sizes, rate=1.0, max_blocks=10**6)
    assert sorted(curves) == [0, 1]
    cached = np.zeros(len(sizes))
    for r, curve in curves.items():
        sub = mrc._select(split, np.flatnonzero(rep == r))
        exact = mrc.exact_hit_rate(sub, sizes)
        assert np.abs(curve.hit_rate - exact).max() < 1e-9
        cached += exact * sub.input_tokens
    assert np.allclose(mrc.fleet_hit_rate(curves, sizes), cached / stream.input_tokens)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"rate": 0.0}, ValueError, "rate"), ({"rate": 1.5}, ValueError, "rate"),
    ({"max_blocks": 0}, ValueError, "max_blocks"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mrc.Shards(16, **kwargs)


def test_bad_stream():
    with pytest.raises(ValueError, match="offsets"):
        bs.BlockStream(np.zeros(3, np.uint64), np.array([0, 2]), np.array([32]), np.array([True]), 16)
    with pytest.raises(ValueError, match="prompt_tokens"):
        bs.BlockStream(np.zeros(2, np.uint64), np.array([0, 2]), np.array([32, 1]), np.array([True]), 16)
