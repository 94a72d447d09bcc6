"""Router examples, each run against both implementations (the `impl` fixture)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from common import same
from kvroute.config import POLICY_PARAMS, RouterConfig

POLICIES = list(POLICY_PARAMS)
BS = 16


def prompt(seed: int, n_tokens: int = 256, prefix: np.ndarray | None = None) -> np.ndarray:
    """Distinct prompts for distinct seeds; `prefix` is copied to the front."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 50_000, n_tokens, dtype=np.int64).astype(np.int32)
    if prefix is not None:
        out[: len(prefix)] = prefix
    return out


def fields(d) -> tuple:
    return (
        d.replica,
        d.replica_id,
        d.matched_blocks,
        d.cached_tokens,
        d.prompt_tokens,
        d.reason,
        d.binding,
        d.stranded_blocks,
        d.handle,
    )


def make(impl, names=("a", "b", "c", "d"), **kw):
    kw.setdefault("block_size", BS)
    return impl.Router(RouterConfig(**kw), list(names))


# -- config -------------------------------------------------------------------------------


def test_config_defaults_and_params():
    cfg = RouterConfig(policy="sglang", params={"cache_threshold": 0.5})
    assert cfg.params == {
        "cache_threshold": 0.5,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "min_match_tokens": 64,
    }
    assert RouterConfig().policy == "ttft"
    assert RouterConfig(policy="sticky").params == {"vnodes": 64, "bound": None}


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        ({"policy": "nope"}, ValueError, "unknown policy 'nope'"),
        ({"policy": 3}, TypeError, "policy must be a str, got int"),
        ({"policy": "sglang", "params": {"x": 1}}, ValueError, "unknown parameter 'x' for policy 'sglang'"),
        ({"policy": "sticky", "params": {"bound": 0.5}}, ValueError, "params['bound'] of policy 'sticky'"),
        ({"policy": "sticky", "params": {"vnodes": 1.5}}, TypeError, "params['vnodes'] of policy 'sticky' must be an int"),
        ({"policy": "dynamo", "params": {"temperature": float("nan")}}, ValueError, "temperature"),
        ({"block_size": 0}, ValueError, "block_size must be in [1, 65536], got 0"),
        ({"mode": "exact"}, ValueError, "mode must be one of approximate, precise, hybrid, got 'exact'"),
        ({"index_capacity": 0}, ValueError, "index_capacity must be >= 1, got 0"),
        ({"session_ttl": 0}, ValueError, "session_ttl must be a finite number > 0"),
        ({"max_sessions": True}, TypeError, "max_sessions must be an int, got bool"),
        ({"salt": 5}, TypeError, "salt must be str, bytes or None, got int"),
        ({"seed": -1}, ValueError, "seed must be in [0, 18446744073709551615], got -1"),
        ({"params": []}, TypeError, "params must be a dict, got list"),
    ],
)
def test_config_rejects(kwargs, exc, msg):
    with pytest.raises(exc) as info:
        RouterConfig(**kwargs)
    assert msg in str(info.value)


def test_router_rejects_non_config(impl):
    with pytest.raises(TypeError, match="config must be a RouterConfig or None, got dict"):
        impl.Router({"policy": "ttft"})
    with pytest.raises(TypeError, match="replicas must be an iterable of names, got a single str"):
        impl.Router(None, "abc")


# -- replicas -----------------------------------------------------------------------------


def test_replica_ids_reuse_and_names(impl):
    r = make(impl, ["a", "b", "c"])
    assert r.replicas == ["a", "b", "c"]
    r.remove_replica("b")
    assert r.replicas == ["a", "c"]
    assert r.add_replica("d") == 1  # lowest free id, same as the index's
    assert r.replica_id("d") == 1
    assert r.index.num_replicas == 3
    with pytest.raises(ValueError, match="replica 'a' already exists"):
        r.add_replica("a")
    with pytest.raises(ValueError, match="replica name must not be empty"):
        r.add_replica("")
    with pytest.raises(TypeError, match="replica name must be a str, got int"):
        r.add_replica(3)
    with pytest.raises(KeyError, match="unknown replica 'b'"):
        r.replica_id("b")


def test_misuse_is_clear_and_changes_nothing(impl):
    r = make(impl, ["a", "b"])
    d = r.route(prompt(1))
    before = (r.load("a"), r.load("b"), r.stats())
    cases = [
        (lambda: r.finish(99), IndexError, "unknown handle 99"),
        (lambda: r.finish(0), IndexError, "unknown handle 0"),
        (lambda: r.finish(2**80), IndexError, f"unknown handle {2**80}"),
        (lambda: r.finish("1"), TypeError, "handle must be an int, got str"),
        (lambda: r.finish(d.handle, now="x"), TypeError, "now must be a number or None, got str"),
        (lambda: r.prefill_done(d.handle, now=float("nan")), ValueError, "now must be finite, got nan"),
        (lambda: r.load("zz"), KeyError, "unknown replica 'zz'"),
        (lambda: r.drain("a", 1), TypeError, "draining must be a bool, got int"),
        (lambda: r.drain("zz"), KeyError, "unknown replica 'zz'"),
        (lambda: r.set_healthy("a", None), TypeError, "healthy must be a bool, got NoneType"),
        (lambda: r.report_load("a", waiting=-1), ValueError, "waiting must be in [0, 2**63), got -1"),
        (lambda: r.report_load("a", running=1.5), TypeError, "running must be an int, got float"),
        (lambda: r.report_load("a", kv_usage=1.5), ValueError, "kv_usage must be in [0, 1], got 1.5"),
        (lambda: r.report_load("a", kv_usage="x"), TypeError, "kv_usage must be a float, got str"),
        (lambda: r.report_load("zz", waiting=-1), KeyError, "unknown replica 'zz'"),
        (lambda: r.route(prompt(2), session=5), TypeError, "session must be a str or None, got int"),
        (lambda: r.route([1, -2]), ValueError, "token -2 at index 1 is out of range [0, 2**32)"),
        (lambda: r.route(prompt(2), now=math.inf), ValueError, "now must be finite, got inf"),
        (lambda: r.route_hashes([1, 2], -5), ValueError, "num_tokens must be in [0, 2**32), got -5"),
        (lambda: r.route_hashes([1, 2], 2.0), TypeError, "num_tokens must be an int, got float"),
        (lambda: r.route_hashes("ab", 2), TypeError, "hashes must be a 1-D integer numpy array"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc) as info:
            fn()
        assert msg in str(info.value), (msg, str(info.value))
    assert (r.load("a"), r.load("b"), r.stats()) == before
    r.finish(d.handle)
    with pytest.raises(RuntimeError, match=f"request {d.handle} already finished"):
        r.finish(d.handle)
    with pytest.raises(RuntimeError, match=f"request {d.handle} already finished"):
        r.prefill_done(d.handle)
    d2 = r.route(prompt(3))
    r.prefill_done(d2.handle)
    with pytest.raises(RuntimeError, match=f"request {d2.handle} already reported its first token"):
        r.prefill_done(d2.handle)


def test_no_eligible_replica(impl):
    r = make(impl, [])
    with pytest.raises(RuntimeError, match="no eligible replica"):
        r.route(prompt(1))
    r.add_replica("a")
    r.add_replica("b")
    r.drain("a")
    r.set_healthy("b", False)
    with pytest.raises(RuntimeError, match="no eligible replica"):
        r.route(prompt(1))
    assert r.stats()["routed"] == 0
    r.set_healthy("b", True)
    assert r.route(prompt(1)).replica == "b"
    r.drain("a", False)
    assert {r.route(prompt(i)).replica for i in range(2, 6)} == {"a", "b"}


def test_chain_conflict_changes_nothing(impl):
    r = make(impl, ["a", "b"], policy="round_robin")
    r.route_hashes([1, 2, 3], 48)
    stats = r.stats()
    with pytest.raises(ValueError, match="already in the index under a different parent"):
        r.route_hashes([2, 3], 32)  # block 2 exists under parent 1
    assert r.stats() == stats
    assert r.route_hashes([7], 16).replica == "b"  # the rotation did not advance on the error


# -- lifecycle and load -------------------------------------------------------------------


def test_load_accounting_lifecycle(impl):
    r = make(impl, ["a"], policy="ttft", params={"min_match_tokens": 0})  # 192 tokens count
    p = prompt(1, 200)  # 12 full blocks + 8 tokens
    d1 = r.route(p)
    assert (d1.matched_blocks, d1.cached_tokens, d1.prompt_tokens) == (0, 0, 200)
    load = r.load("a")
    assert load["queued_prefill_tokens"] == 200
    assert (load["in_flight"], load["prefill_blocks"], load["decode_blocks"], load["active_blocks"]) == (1, 12, 0, 12)
    d2 = r.route(p)  # approximate mode: the first route inserted the blocks
    assert (d2.matched_blocks, d2.cached_tokens, d2.reason) == (12, 192, "affinity")
    load = r.load("a")
    assert load["queued_prefill_tokens"] == 208 and load["prefill_blocks"] == 12
    r.prefill_done(d1.handle)
    load = r.load("a")
    assert (load["queued_prefill_tokens"], load["prefill_blocks"], load["decode_blocks"]) == (8, 0, 12)
    r.finish(d1.handle)
    r.finish(d2.handle)  # finish before first token is allowed (cancelled request)
    load = r.load("a")
    assert [load[k] for k in ("queued_prefill_tokens", "in_flight", "prefill_blocks", "decode_blocks")] == [0, 0, 0, 0]
    r.report_load("a", waiting=3, kv_usage=0.5)
    r.report_load("a", running=2)
    load = r.load("a")
    assert (load["waiting"], load["running"], load["kv_usage"]) == (3, 2, 0.5)


def test_remove_replica_releases_in_flight(impl):
    r = make(impl, ["a", "b"], policy="least_loaded")
    handles = [r.route(prompt(i)) for i in range(6)]
    on_a = [d.handle for d in handles if d.replica == "a"]
    assert len(on_a) == 3
    r.prefill_done(on_a[0])
    r.remove_replica("a")
    assert r.stats()["in_flight"] == 6  # handles stay valid until finished
    r.prefill_done(on_a[1])  # no-op
    for h in on_a:
        r.finish(h)  # no-op on the load, accepted
    with pytest.raises(RuntimeError, match="already finished"):
        r.finish(on_a[0])
    assert r.add_replica("a2") == 0
    assert r.load("a2")["in_flight"] == 0
    assert r.load("b")["in_flight"] == 3
    for d in handles:
        if d.replica == "b":
            r.finish(d.handle)
    assert r.stats()["in_flight"] == 0
    assert r.load("b")["in_flight"] == 0


# -- ties and spreading -------------------------------------------------------------------


@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("random", "power_of_two", "sticky")])
def test_concurrency_one_misses_spread_evenly(impl, policy):
    r = make(impl, [f"r{i}" for i in range(4)], policy=policy)
    counts = Counter()
    for i in range(40):
        d = r.route(prompt(i))
        counts[d.replica] += 1
        r.prefill_done(d.handle)
        r.finish(d.handle)
    assert counts == {f"r{i}": 10 for i in range(4)}


@pytest.mark.parametrize("policy", ["random", "power_of_two", "sticky"])
def test_concurrency_one_randomized_policies_use_the_fleet(impl, policy):
    r = make(impl, [f"r{i}" for i in range(4)], policy=policy)
    counts = Counter()
    for i in range(80):
        d = r.route(prompt(i))
        counts[d.replica] += 1
        r.finish(d.handle)
    assert len(counts) == 4 and max(counts.values()) <= 40


@pytest.mark.parametrize("policy", ["ttft", "linear", "dynamo", "least_loaded", "round_robin", "power_of_two"])
def test_shared_prefix_is_not_sent_to_one_replica(impl, policy):
    system = prompt(10_000, 192)
    r = make(impl, [f"r{i}" for i in range(8)], policy=policy)
    # 256 requests, none finished: ttft opens another replica once the holders' queues
    # outweigh fleet_weight (8) times the shared prefix it would prefill again.
    counts = Counter(r.route(prompt(i, 256, system)).replica for i in range(256))
    assert len(counts) == 8
    assert max(counts.values()) <= 2 * 256 / 8


def test_ttft_prefers_cache_until_queue_outweighs_it(impl):
    # fleet_weight 1 (the default is 3, tuned on kvroute simulate): the arithmetic below.
    r = make(impl, ["a", "b"], policy="ttft", params={"fleet_weight": 1.0})
    p = prompt(1, 1024)
    first = r.route(p)
    # (Every replica also pays one step of step_tokens; no decodes yet.)
    # Holder: 1024 queued + 0 uncached; other: 0 + 1024 uncached + 1024 extra fleet prefill.
    second = r.route(p)
    assert second.replica == first.replica and second.reason == "affinity"
    # Half cached: holder 1024 + 512 + 0; other 0 + 1024 + 512. Equal: the longer match wins.
    third = r.route(prompt(2, 1024, p[:512]))
    assert (third.replica, third.reason) == (first.replica, "affinity")
    # Holder 1536 + 512 + 0 against 0 + 1024 + 512: the queue outweighs the cache.
    fourth = r.route(prompt(3, 1024, p[:512]))
    assert fourth.replica != first.replica and fourth.reason == "load"
    r.prefill_done(first.handle)
    # Holder's queue down to 512: 512 + 512 beats 1024 + 1024 + 512.
    fifth = r.route(prompt(4, 1024, p[:512]))
    assert (fifth.replica, fifth.matched_blocks, fifth.reason) == (first.replica, 32, "affinity")


def test_ttft_counts_the_decode_steps_it_waits_through(impl):
    r = make(impl, ["a", "b"], policy="ttft")
    first = r.route(prompt(1, 8192))
    r.prefill_done(first.handle)  # one decode reading 8,192 KV tokens per step
    other = "b" if first.replica == "a" else "a"
    for i in (2, 3):
        d = r.route(prompt(i, 16))
        # 16 + 1 step x (120 + 1 decode + 0.001 x 8,192) > 16 + 1 step x (120 + the others' decodes)
        assert d.replica == other
        r.prefill_done(d.handle)
    # Two short decodes (2 + 0.032) cost less per step than one long one (1 + 8.192): the
    # replica with more requests in flight wins, where a FIFO estimate would tie and pick
    # the fewer in flight.
    assert r.route(prompt(4, 1024)).replica == other


# -- policies -----------------------------------------------------------------------------


def test_round_robin_rotates(impl):
    r = make(impl, ["a", "b", "c"], policy="round_robin")
    assert [r.route(prompt(0)).replica for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_sglang_affinity_and_imbalance(impl):
    r = make(impl, ["a", "b"], policy="sglang", params={"balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    p = prompt(1)
    first = r.route(p)
    assert first.reason == "miss"
    reasons = []
    for _ in range(5):
        d = r.route(p)
        reasons.append((d.replica, d.reason))
    # Affinity to the holder until max - min > 2 and max > 1.5 * min, then least loaded.
    assert reasons[0] == (first.replica, "affinity")
    assert ("b" if first.replica == "a" else "a", "load") in reasons


def test_linear_min_match_and_escape(impl):
    r = make(impl, ["a", "b", "c"], policy="linear", params={"min_match_tokens": 128, "escape_factor": 1.2, "w_load": 0.0})
    p = prompt(1, 256)
    first = r.route(p)
    assert first.reason == "miss"
    short = prompt(2, 256, p[:64])  # 64 matched tokens < 128: no affinity
    assert r.route(short).reason == "miss"
    d = r.route(p)  # full match on the holder; its queue 256 > 1.2 * mean (256+256+0)/3
    assert (d.reason, d.replica_id) == ("load", 2)  # the least loaded


def test_dynamo_temperature_is_seeded(impl):
    def run(seed):
        r = make(impl, [f"r{i}" for i in range(5)], policy="dynamo", params={"temperature": 1.0}, seed=seed)
        return [r.route(prompt(i % 7)).replica for i in range(30)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_llmd_uses_reported_kv_usage(impl):
    r = make(impl, ["a", "b"], policy="llmd")
    r.report_load("a", waiting=0, kv_usage=0.9)
    r.report_load("b", waiting=0)  # reported queues replace the router's own counts
    assert [r.route(prompt(i)).replica for i in range(3)] == ["b", "b", "b"]


def test_preble_exploits_long_matches(impl):
    r = make(impl, ["a", "b", "c"], policy="preble")
    p = prompt(1, 512)
    first = r.route(p)
    d = r.route(prompt(2, 512, p[:400]))  # 25 of 32 blocks cached: exploit the holder
    assert (d.replica, d.reason) == (first.replica, "affinity")
    d = r.route(prompt(3, 512, p[:100]))  # 6 blocks cached, 416 new tokens: explore
    assert d.replica != first.replica


def test_sticky_ring_is_stable_and_moves_little(impl):
    names = [f"r{i}" for i in range(6)]
    r = make(impl, names, policy="sticky")
    sessions = [f"user-{i}" for i in range(300)]
    before = {s: r.route(prompt(0), session=s).replica for s in sessions}
    assert len(set(before.values())) == 6
    r2 = make(impl, names + ["r6"], policy="sticky")
    after = {s: r2.route(prompt(0), session=s).replica for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "r6" for s in moved)  # consistent hashing: only moves to the new one
    assert len(moved) < 300 * 0.3


@pytest.mark.parametrize("c", [1.0, 1.25, 2.0])
def test_sticky_bounded_loads_invariant(impl, c):
    r = make(impl, [f"r{i}" for i in range(5)], policy="sticky", params={"bound": c})
    live = []
    rng = np.random.default_rng(0)
    overflow = 0
    for i in range(300):
        d = r.route(prompt(i % 3), session=f"s{rng.integers(0, 7)}")
        overflow += d.reason == "overflow"
        live.append(d.handle)
        loads = [r.load(f"r{k}")["in_flight"] for k in range(5)]
        assert loads[d.replica_id] <= math.ceil(c * sum(loads) / 5)
        if rng.random() < 0.3:
            r.finish(live.pop(int(rng.integers(0, len(live)))))
    if c == 1.0:
        assert overflow > 0


# -- sessions -----------------------------------------------------------------------------


def test_session_kept_then_rebound_when_drained(impl):
    r = make(impl, ["a", "b", "c"], policy="ttft")
    d1 = r.route(prompt(1, 320), session="s")
    assert d1.binding == "new"
    d2 = r.route(prompt(2, 160), session="s")
    assert (d2.replica, d2.binding, d2.reason) == (d1.replica, "kept", "session")
    r.drain(d1.replica)
    d3 = r.route(prompt(3), session="s")
    assert d3.binding == "rebound" and d3.replica != d1.replica
    assert d3.stranded_blocks == 10  # the last prompt's blocks on the previous replica
    d4 = r.route(prompt(4), session="s")
    assert (d4.replica, d4.binding) == (d3.replica, "kept")
    r.set_healthy(d3.replica, False)
    assert r.route(prompt(5), session="s").binding == "rebound"
    assert r.stats()["rebinds"] == 2


def test_session_rebound_when_replica_removed_and_id_reused(impl):
    r = make(impl, ["a", "b"], policy="round_robin")
    d1 = r.route(prompt(1), session="s")
    r.remove_replica(d1.replica)
    r.add_replica("new")  # takes the removed id
    d2 = r.route(prompt(1), session="s")
    assert d2.binding == "rebound" and d2.stranded_blocks == 16


def test_session_rebound_when_saturated(impl):
    r = make(impl, ["a", "b"], policy="least_loaded", session_saturation=1.5)
    d = r.route(prompt(0), session="s")
    second = r.route(prompt(1), session="s")  # in-flight 1 <= max(1, 1.5 * 0.5): stays
    assert (second.replica, second.binding) == (d.replica, "kept")
    third = r.route(prompt(2), session="s")  # 2 > 1.5 * 1: saturated
    assert third.binding == "rebound" and third.replica != d.replica and third.stranded_blocks == 16


def test_session_ttl_and_lru(impl):
    r = make(impl, ["a", "b", "c"], policy="round_robin", session_ttl=10.0, max_sessions=3)
    def turn(now):
        d = r.route(prompt(0), session="x", now=now)
        r.finish(d.handle)
        return d.binding

    assert [turn(0.0), turn(9.0), turn(18.5), turn(28.5)] == ["new", "kept", "kept", "new"]  # sliding
    for s in "pqrs":
        r.route(prompt(0), session=s, now=30.0)
    st = r.stats()
    assert st["sessions"] == 3 and st["session_evictions"] == 2 and st["session_expirations"] == 1
    assert r.route(prompt(0), session="p", now=30.0).binding == "new"  # evicted by LRU


# -- index modes --------------------------------------------------------------------------


def test_precise_mode_only_reads_the_index(impl):
    r = make(impl, ["a", "b"], mode="precise", params={"min_match_tokens": 0})  # 160 tokens count
    p = prompt(1)
    first = r.route(p)
    assert first.matched_blocks == 0
    assert r.index.num_blocks == 0
    r.finish(first.handle)  # nothing pending: what the router knows is the index alone
    hashes = impl.block_hashes(p, BS)
    r.index.insert(r.replica_id("b"), hashes[:10])  # an engine event
    d = r.route(p)
    assert (d.replica, d.matched_blocks, d.cached_tokens) == ("b", 10, 160)


def test_hybrid_speculative_insertions_expire(impl):
    r = make(impl, ["a", "b"], mode="hybrid", speculative_ttl=5.0)
    p = prompt(1)
    first = r.route(p, now=100.0)
    assert r.index.num_blocks == 0 and r.speculative_index.num_blocks == 16
    d = r.route(p, now=101.0)
    assert (d.replica, d.matched_blocks) == (first.replica, 16)
    r.finish(first.handle)
    r.finish(d.handle)
    assert r.route(p, now=107.0).matched_blocks == 0
    assert make(impl, ["a"]).speculative_index is None


def test_route_hashes_caps_cached_tokens(impl):
    r = make(impl, ["a"], block_size=512)
    r.route_hashes([11, 12, 13], 1100)
    d = r.route_hashes(np.array([11, 12, 13], dtype=np.uint64), 1100)
    assert (d.matched_blocks, d.cached_tokens, d.prompt_tokens) == (3, 1100, 1100)


def test_salt_separates_tenants(impl):
    r1 = make(impl, ["a"], salt="tenant-1")
    p = prompt(1)
    r1.route(p)
    assert r1.index.match(impl.block_hashes(p, BS, salt="tenant-1")).tolist() == [16]
    assert r1.index.match(impl.block_hashes(p, BS)).tolist() == [0]


def test_decisions_are_identical_across_implementations():
    def run(mod):
        r = mod.Router(RouterConfig(policy="ttft", block_size=BS), ["a", "b", "c"])
        out = [fields(r.route(prompt(i % 4, 200), session=f"s{i % 3}", now=float(i))) for i in range(20)]
        out.append(repr(r.route([1] * 40)))
        return out

    same(run)


def test_ids_taken_on_the_index_directly_are_skipped(impl):
    r = make(impl, ["a"], policy="round_robin")
    assert r.index.add_replica() == 1  # not through the Router: a dead slot for it
    assert r.add_replica("b") == 2
    assert r.replicas == ["a", "b"]
    assert {r.route(prompt(i)).replica for i in range(4)} == {"a", "b"}
