"""Router defects from the reliability issue (11: items 1, 5, 6, 9, 10) and its bounded
resources: requests never finished expire, session ids are bounded in bytes, params are
frozen. Each runs on both implementations."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from common import same
from kvroute.config import RouterConfig, validated


def make(impl, names=("a", "b"), **kw):
    kw.setdefault("block_size", 16)
    return impl.Router(RouterConfig(**kw), list(names))


# -- 1. num_tokens cannot overflow the load accounting ----------------------------------


def test_num_tokens_beyond_2_32_is_rejected_and_changes_nothing(impl):
    r = make(impl, policy="least_loaded")
    before = (r.load("a"), r.stats())
    for bad in (2**32, 2**62, 2**63 - 1, 2**64):
        with pytest.raises(ValueError, match=rf"num_tokens must be in \[0, 2\*\*32\), got {bad}"):
            r.route_hashes([1], bad)
    assert (r.load("a"), r.stats()) == before


def test_largest_num_tokens_is_accounted_exactly_in_both():
    def run(m):
        r = m.Router(RouterConfig(policy="ttft", mode="precise"), ["a", "b"])
        ds = [r.route_hashes([1, 2], 2**32 - 1, now=0.0) for _ in range(5)]
        return [d.replica for d in ds], r.load("a"), r.load("b"), r.stats()

    got = same(run)
    assert got[0] == "ok"
    assert got[1][1][3]["prompt_tokens"] == 5 * (2**32 - 1)


# -- 5. the native router validates whatever config object it is handed -----------------


class Unchecked(RouterConfig):
    """A subclass that skips RouterConfig's checks."""

    def __post_init__(self) -> None:
        pass


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        ({"block_size": 0}, ValueError, "block_size must be in [1, 65536], got 0"),
        ({"policy": "nope"}, ValueError, "unknown policy 'nope'"),
        ({"policy": "sticky", "params": {"vnodes": 0}}, ValueError, "params['vnodes'] of policy 'sticky'"),
        ({"max_sessions": 0}, ValueError, "max_sessions must be >= 1, got 0"),
        ({"session_ttl": float("nan")}, ValueError, "session_ttl must be a finite number > 0"),
        ({"request_ttl": -1.0}, ValueError, "request_ttl must be a finite number > 0"),
        ({"params": None}, TypeError, "params must be a dict, got NoneType"),
    ],
)
def test_unchecked_config_subclass_raises_not_crashes(impl, kwargs, exc, msg):
    cfg = Unchecked(**kwargs)
    with pytest.raises(exc) as info:
        impl.Router(cfg, ["a"])
    assert msg in str(info.value)


def test_config_subclass_that_validates_is_used_as_its_fields(impl):
    r = impl.Router(Unchecked(policy="least_loaded", block_size=4), ["a"])
    assert type(r.config) is RouterConfig
    assert r.config == RouterConfig(policy="least_loaded", block_size=4)
    assert r.route(list(range(8))).matched_blocks == 0


# -- params are frozen --------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.__setitem__("bound", 2.0),
        lambda p: p.__delitem__("vnodes"),
        lambda p: p.update(vnodes=3),
        lambda p: p.pop("vnodes"),
        lambda p: p.popitem(),
        lambda p: p.clear(),
        lambda p: p.setdefault("x", 1),
    ],
)
def test_params_are_read_only_in_both(impl, mutate):
    cfg = RouterConfig(policy="sticky")
    r = impl.Router(cfg, ["a", "b"])
    for params in (cfg.params, r.config.params):
        with pytest.raises(TypeError, match="RouterConfig.params is read-only"):
            mutate(params)
    assert cfg.params == {"vnodes": 64, "bound": None}
    assert r.route_hashes([5], 16, session="s").reason == "hash"


def test_frozen_params_still_behave_as_a_dict():
    cfg = RouterConfig(policy="dynamo", params={"temperature": 0.5})
    assert isinstance(cfg.params, dict) and cfg.params["temperature"] == 0.5
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert copy.deepcopy(cfg) == cfg
    assert dataclasses.replace(cfg, seed=3).params == cfg.params
    assert validated(cfg) == cfg and validated(None) == RouterConfig()
    with pytest.raises(TypeError, match="config must be a RouterConfig or None, got dict"):
        validated({})
    params = dict(cfg.params)
    params["temperature"] = 1.0  # a copy is an ordinary dict
    assert RouterConfig(policy="dynamo", params=params).params["temperature"] == 1.0


# -- 6. lone surrogates -------------------------------------------------------------------


def test_lone_surrogates_are_a_clear_value_error_in_both():
    def session(m):
        r = m.Router(RouterConfig(), ["a"])
        return r.route_hashes([1], 16, session="ok\ud800")

    assert same(session) == ("raise", ("ValueError", "session must be encodable as UTF-8, got a lone surrogate at index 2"))
    got = same(lambda m: m.Router(RouterConfig(), ["\udc00x"]))
    assert got == ("raise", ("ValueError", "replica name must be encodable as UTF-8, got a lone surrogate at index 0"))


# -- 9. the sticky ring is updated per change, and equals one built from scratch ----------


def sticky_picks(r, n=300):
    return [r.route_hashes([], 0, session=f"user-{i}").replica for i in range(n)]


def test_sticky_ring_after_churn_equals_a_fresh_ring(impl):
    cfg = RouterConfig(policy="sticky", params={"vnodes": 16})
    churned = impl.Router(cfg, [f"r{i}" for i in range(10)])
    churned.remove_replica("r3")
    churned.remove_replica("r7")
    churned.add_replica("r10")  # takes id 3
    churned.add_replica("r7")  # back, id 7
    churned.remove_replica("r0")
    fresh = impl.Router(cfg, ["x", "r1", "r2", "r10", "r4", "r5", "r6", "r7", "r8", "r9"])
    fresh.remove_replica("x")
    assert churned.replicas == fresh.replicas
    assert sticky_picks(churned) == sticky_picks(fresh)
    assert set(sticky_picks(churned)) == set(fresh.replicas)


# -- 10. hybrid mode after router.index.add_replica() -------------------------------------


@pytest.mark.parametrize("mode", ["hybrid", "approximate", "precise"])
def test_direct_index_ids_leave_routing_intact(impl, mode):
    r = make(impl, ["a"], policy="round_robin", mode=mode)
    assert r.index.add_replica() == 1  # an id the Router does not know
    assert r.add_replica("b") == 2
    r.index.add_replica()  # 3
    r.index.remove_replica(1)
    assert r.add_replica("c") == 1
    seen = set()
    for i in range(12):
        d = r.route_hashes([100 + i, 200 + i], 32, now=0.0)
        seen.add(d.replica)
    assert seen == {"a", "b", "c"}
    if mode == "hybrid":
        spec = r.speculative_index
        d = r.route_hashes([7, 8], 32, now=0.0)
        assert spec.match(np.array([7, 8], dtype=np.uint64)).tolist()[d.replica_id] == 2
    r.remove_replica("b")
    assert r.add_replica("b") == 2
    assert {r.route_hashes([i], 16, now=0.0).replica for i in range(6)} == {"a", "b", "c"}


# -- requests never finished expire --------------------------------------------------------


def test_unfinished_requests_expire_after_request_ttl(impl):
    r = make(impl, policy="ttft", mode="precise", request_ttl=10.0, params={"min_match_tokens": 0})
    hashes = list(range(1, 11))
    leaked = r.route_hashes(hashes, 160, now=0.0)  # never finished
    assert r.route_hashes(hashes, 160, now=5.0).matched_blocks == 10  # pending twin counts
    assert r.stats()["in_flight"] == 2
    d = r.route_hashes(hashes, 160, now=10.0)  # the leaked one (routed at 0) expired first
    assert r.stats()["request_expirations"] == 1
    assert d.replica == leaked.replica and d.matched_blocks == 10  # the one at t=5 is pending
    with pytest.raises(RuntimeError, match=f"request {leaked.handle} already finished or expired"):
        r.finish(leaked.handle)
    r.route_hashes([99], 16, now=100.0)
    st = r.stats()
    assert (st["request_expirations"], st["in_flight"]) == (3, 1)
    loads = [r.load(n) for n in ("a", "b")]
    assert sum(x["in_flight"] for x in loads) == 1
    assert sum(x["queued_prefill_tokens"] for x in loads) == 16
    assert sum(x["prefill_blocks"] for x in loads) == 1


def test_expired_prefilled_request_releases_its_decode_blocks(impl):
    r = make(impl, policy="least_loaded", request_ttl=1.0)
    d = r.route_hashes([1, 2, 3], 48, now=0.0)
    r.prefill_done(d.handle)
    assert r.load(d.replica)["decode_blocks"] == 3
    r.route_hashes([9], 16, now=2.0)
    assert r.load(d.replica)["decode_blocks"] == 0
    assert r.stats()["request_expirations"] == 1


def test_request_expiry_is_identical_in_both():
    def run(m):
        r = m.Router(RouterConfig(policy="ttft", request_ttl=3.0), ["a", "b", "c"])
        out = []
        for i in range(40):
            d = r.route_hashes([i % 5, 1000 + 10 * (i % 5) + i % 7], 32, now=i * 0.5)
            out.append((d.replica, d.matched_blocks))
            if i % 3 == 0:
                r.finish(d.handle)
        return out, r.stats(), [r.load(n) for n in ("a", "b", "c")]

    assert same(run)[0] == "ok"


# -- session ids are bounded in bytes --------------------------------------------------------


def test_session_table_is_bounded_in_bytes(impl):
    r = make(impl, policy="least_loaded", max_session_bytes=100)
    for i in range(4):
        r.route_hashes([i], 16, session=f"{i}" * 30, now=float(i))
    st = r.stats()
    assert (st["sessions"], st["session_bytes"], st["session_evictions"]) == (3, 90, 1)
    before = (r.stats(), r.load("a"))
    with pytest.raises(ValueError, match=r"session must be at most 100 bytes \(max_session_bytes\), got 101"):
        r.route_hashes([1], 16, session="x" * 101)
    assert (r.stats(), r.load("a")) == before
    r.route_hashes([1], 16, session="é" * 50, now=9.0)  # 100 bytes of UTF-8
    assert r.stats()["session_bytes"] == 100 and r.stats()["sessions"] == 1


def test_session_bytes_follow_expiry_and_rebinding(impl):
    r = make(impl, policy="least_loaded", session_ttl=5.0)
    r.route_hashes([1], 16, session="abc", now=0.0)
    r.route_hashes([1], 16, session="abc", now=1.0)
    assert r.stats()["session_bytes"] == 3
    r.route_hashes([1], 16, session="de", now=10.0)  # abc expired
    st = r.stats()
    assert (st["sessions"], st["session_bytes"], st["session_expirations"]) == (1, 2, 1)
