"""Idle fleets spread: ties go to the least recently chosen replica (issue 10 section 1) and
a match shorter than min_match_tokens counts as none (section 2). Every cache-aware
policy, every index mode, both implementations."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvroute.config import POLICY_PARAMS, RouterConfig

CACHE_AWARE = [p for p, params in POLICY_PARAMS.items() if "min_match_tokens" in params]
MODES = ["approximate", "precise", "hybrid"]
REPLICAS = [f"r{i}" for i in range(8)]


def assert_spread(counts: Counter, total: int) -> None:
    """Each of the 8 replicas gets between half and twice its even share."""
    share = total / len(REPLICAS)
    got = [counts.get(name, 0) for name in REPLICAS]
    assert all(share / 2 <= c <= 2 * share for c in got), got


def conversations(impl, policy, mode, turns, mixed):
    """32 conversations at concurrency 1; each turn is the previous prompt plus a reply."""
    r = impl.Router(RouterConfig(policy=policy, mode=mode), REPLICAS)
    rng = np.random.default_rng(0)
    counts: Counter = Counter()
    stayed = 0  # conversations whose every turn went to one replica
    for _ in range(32):
        p = rng.integers(0, 50_000, int(rng.integers(20, 600)) if mixed else 300)
        seen = set()
        for _ in range(turns):
            d = r.route(p)
            r.prefill_done(d.handle)
            r.finish(d.handle)
            counts[d.replica] += 1
            seen.add(d.replica)
            p = np.concatenate([p, rng.integers(0, 50_000, int(rng.integers(10, 400)) if mixed else 200)])
        stayed += len(seen) == 1
    return counts, stayed


def test_cache_aware_policies_are_the_ones_with_affinity():
    assert set(CACHE_AWARE) == {"linear", "sglang", "dynamo", "llmd", "preble", "ttft"}


@pytest.mark.parametrize("policy", CACHE_AWARE)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("turns, mixed", [(4, False), (8, False), (6, True)], ids=["4-turn", "8-turn", "mixed"])
def test_conversations_spread_over_an_idle_fleet(impl, policy, mode, turns, mixed):
    counts, stayed = conversations(impl, policy, mode, turns, mixed)
    assert_spread(counts, 32 * turns)
    if mode != "precise" and not mixed:  # the index sees each turn: affinity keeps them together
        assert stayed == 32


@pytest.mark.parametrize("policy", CACHE_AWARE)
@pytest.mark.parametrize("mode", MODES)
def test_shared_template_alone_is_not_affinity(impl, policy, mode):
    r = impl.Router(RouterConfig(policy=policy, mode=mode), REPLICAS)
    rng = np.random.default_rng(1)
    template = rng.integers(0, 50_000, 32)
    counts: Counter = Counter()
    for _ in range(64):
        d = r.route(np.concatenate([template, rng.integers(0, 50_000, 400)]))
        r.prefill_done(d.handle)
        r.finish(d.handle)
        counts[d.replica] += 1
        assert d.reason in ("miss", "balance") or d.matched_blocks * 16 >= 64
    assert_spread(counts, 64)


@pytest.mark.parametrize("policy", CACHE_AWARE)
def test_min_match_tokens_zero_routes_on_the_template(impl, policy):
    """The knob is real: with 0, a 2-block template match is affinity again."""
    params = {"min_match_tokens": 0}
    if policy == "sglang":
        params["cache_threshold"] = 0.0
    r = impl.Router(RouterConfig(policy=policy, params=params, mode="approximate"), REPLICAS)
    rng = np.random.default_rng(1)
    template = rng.integers(0, 50_000, 32)
    first = r.route(np.concatenate([template, rng.integers(0, 50_000, 400)]))
    r.prefill_done(first.handle)
    r.finish(first.handle)
    d = r.route(np.concatenate([template, rng.integers(0, 50_000, 400)]))
    assert (d.replica, d.matched_blocks, d.reason) == (first.replica, 2, "affinity")


def test_min_match_tokens_leaves_the_decision_accounting_alone(impl):
    """Below the threshold the match is not scored, but what is cached is still reported."""
    r = impl.Router(RouterConfig(policy="ttft", mode="precise"), ["a", "b"])
    hashes = list(range(100, 110))
    r.index.insert(1, hashes[:2])  # 32 tokens on b: below the default 64
    d = r.route_hashes(hashes, 160)
    assert (d.replica, d.reason) == ("a", "miss")  # a tie on score: the lower id, never chosen
    r.finish(d.handle)
    d = r.route_hashes(hashes, 160)  # a tie again: b, chosen longest ago
    assert (d.replica, d.matched_blocks, d.cached_tokens, d.reason) == ("b", 2, 32, "miss")


def test_ties_go_to_the_least_recently_chosen(impl):
    r = impl.Router(RouterConfig(policy="least_loaded"), ["a", "b", "c"])
    picks = [r.route_hashes([i], 16).replica for i in range(3)]
    assert picks == ["a", "b", "c"]
    h = r.route_hashes([9], 16)  # all have one in flight: a, chosen longest ago
    assert h.replica == "a"
    r.add_replica("d")  # never chosen: first among equals (d has 0 in flight anyway)
    assert r.route_hashes([10], 16).replica == "d"
