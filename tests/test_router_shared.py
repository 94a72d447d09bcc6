"""Several routers, one fleet (contract C6): external load, session binding and other
routers' route-time inserts, on both implementations (`impl`), with identical errors."""

from __future__ import annotations

import numpy as np
import pytest

from common import same
from kvroute.config import RouterConfig

NAMES = ["a", "b", "c"]
TERMS = ("in_flight", "queued_prefill_tokens", "prefill_requests", "prefill_blocks", "decode_blocks")


def make(impl, names=NAMES, **kw):
    kw.setdefault("block_size", 4)
    return impl.Router(RouterConfig(**kw), names)


def prompt(seed: int, n: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, n).astype(np.uint32)


def counts(load: dict) -> dict:
    """load() without the own/external parts."""
    return {k: v for k, v in load.items() if k not in ("own", "external")}


# -- set_external_load and load() ------------------------------------------------------------


def test_load_reports_own_external_and_sums(impl):
    r = make(impl, policy="least_loaded")
    d = r.route(prompt(1), now=0.0)
    r.set_external_load(d.replica, in_flight=3, queued_prefill_tokens=100, prefill_requests=2,
                        prefill_blocks=7, decode_blocks=11)  # fmt: skip
    load = r.load(d.replica)
    assert load["own"] == {"in_flight": 1, "queued_prefill_tokens": 32, "prefill_requests": 1,
                           "prefill_blocks": 8, "decode_blocks": 0}  # fmt: skip
    assert load["external"] == {"in_flight": 3, "queued_prefill_tokens": 100, "prefill_requests": 2,
                                "prefill_blocks": 7, "decode_blocks": 11}  # fmt: skip
    for k in TERMS:
        assert load[k] == load["own"][k] + load["external"][k]
    assert load["active_blocks"] == 8 + 7 + 11
    # Replaced, not added; the lifecycle moves only the own part.
    r.set_external_load(d.replica, in_flight=1)
    r.prefill_done(d.handle)
    load = r.load(d.replica)
    assert load["external"] == dict.fromkeys(TERMS, 0) | {"in_flight": 1}
    assert load["own"] == {"in_flight": 1, "queued_prefill_tokens": 0, "prefill_requests": 0,
                           "prefill_blocks": 0, "decode_blocks": 8}  # fmt: skip
    r.finish(d.handle)
    assert r.load(d.replica)["in_flight"] == 1 and r.load(d.replica)["own"]["in_flight"] == 0


def test_remove_replica_drops_external_load(impl):
    r = make(impl)
    r.set_external_load("b", in_flight=4, decode_blocks=9)
    r.remove_replica("b")
    r.add_replica("b")
    assert r.load("b")["external"] == dict.fromkeys(TERMS, 0)
    assert counts(r.load("b")) == counts(make(impl).load("b"))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "zz"}, "KeyError"),
        ({"name": 3}, "TypeError"),
        ({"in_flight": True}, "TypeError"),
        ({"in_flight": 1.0}, "TypeError"),
        ({"in_flight": 5, "decode_blocks": "1"}, "TypeError"),
        ({"queued_prefill_tokens": -1}, "ValueError"),
        ({"prefill_requests": 2**40 + 1}, "ValueError"),
        ({"in_flight": 5, "decode_blocks": 2**64}, "ValueError"),
        ({"in_flight": 5, "prefill_blocks": np.int64(-3)}, "ValueError"),
    ],
)
def test_set_external_load_errors_change_nothing(kwargs, error):
    def run(m):
        r = make(m)
        r.set_external_load("a", in_flight=2, prefill_blocks=3)
        args = {"name": "a"} | kwargs
        name = args.pop("name")
        before = r.load("a")
        try:
            r.set_external_load(name, **args)
        finally:
            assert r.load("a") == before

    kind, (exc, _msg) = same(run)
    assert (kind, exc) == ("raise", error)


def test_set_external_load_bounds_name_the_field(impl):
    r = make(impl)
    r.set_external_load("a", **dict.fromkeys(TERMS, 2**40))
    assert r.load("a")["external"] == dict.fromkeys(TERMS, 2**40)
    with pytest.raises(ValueError, match=r"decode_blocks must be in \[0, 2\*\*40\], got -1"):
        r.set_external_load("a", decode_blocks=-1)
    with pytest.raises(TypeError, match="in_flight must be an int, got bool"):
        r.set_external_load("a", in_flight=False)


@pytest.mark.parametrize(
    ("policy", "term"),
    [
        ("least_loaded", "in_flight"),
        ("power_of_two", "in_flight"),
        ("linear", "queued_prefill_tokens"),
        ("sglang", "in_flight"),
        ("dynamo", "prefill_blocks"),
        ("dynamo", "decode_blocks"),
        ("llmd", "prefill_requests"),
        ("preble", "queued_prefill_tokens"),
        ("ttft", "queued_prefill_tokens"),
        ("ttft", "decode_blocks"),
    ],
)
def test_every_load_driven_policy_avoids_external_load(impl, policy, term):
    """Two replicas, one carrying only another router's load: every fresh prompt goes to
    the other, as it would if this router had routed that load itself."""
    r = make(impl, ["a", "b"], policy=policy)
    r.set_external_load("a", **{term: 10_000})
    for i in range(6):
        d = r.route(prompt(100 + i), now=float(i))
        assert d.replica == "b", (i, d)
        r.finish(d.handle)


def test_bounded_load_counts_external_in_flight(impl):
    """sticky with a bound: a session's replica over capacity (own + external) overflows."""
    r = make(impl, ["a", "b"], policy="sticky", params={"bound": 1.0})
    d = r.route(prompt(7), session="s", now=0.0)
    r.finish(d.handle)
    other = "b" if d.replica == "a" else "a"
    assert r.route(prompt(7), session="s", now=1.0).replica == d.replica
    r.set_external_load(d.replica, in_flight=50)
    d2 = r.route(prompt(7), session="t", now=2.0)
    assert d2.replica == other or d2.reason == "overflow"


def test_session_saturation_counts_external_in_flight(impl):
    r = make(impl, policy="least_loaded", session_saturation=2.0)
    d = r.route(prompt(3), session="s", now=0.0)
    r.finish(d.handle)
    r.set_external_load(d.replica, in_flight=5)
    d2 = r.route(prompt(3), session="s", now=1.0)
    assert d2.binding == "rebound" and d2.replica != d.replica


# -- bind_session / session ------------------------------------------------------------------


def test_bind_session_then_route_keeps_it(impl):
    r = make(impl, policy="least_loaded", session_ttl=10.0)
    assert r.session("s", now=0.0) is None
    r.bind_session("s", "c", now=0.0)
    assert r.session("s", now=5.0) == "c"
    assert r.stats()["sessions"] == 1 and r.stats()["routed"] == 0
    d = r.route(prompt(1), session="s", now=9.0)
    assert (d.replica, d.reason, d.binding) == ("c", "session", "kept")
    # session() does not refresh; route did (sliding TTL from 9.0).
    assert r.session("s", now=18.9) == "c"
    assert r.session("s", now=19.0) is None


def test_bind_session_rebinds_and_keeps_blocks_only_on_same_replica(impl):
    r = make(impl, policy="least_loaded", session_ttl=100.0)
    d = r.route(prompt(1, 40), session="s", now=0.0)  # 10 blocks
    r.finish(d.handle)
    r.bind_session("s", d.replica, now=1.0)  # same replica: its blocks are still there
    other = next(n for n in NAMES if n != d.replica)
    r.set_healthy(d.replica, False)
    d2 = r.route(prompt(2), session="s", now=2.0)
    assert d2.binding == "rebound" and d2.stranded_blocks == 10
    r.finish(d2.handle)
    r.set_healthy(d.replica, True)
    r.bind_session("s", other, now=3.0)
    assert r.session("s", now=3.0) == other
    r.set_healthy(other, False)
    d3 = r.route(prompt(3), session="s", now=4.0)
    # bound elsewhere by another router: the blocks there are unknown, under-claimed as 0
    assert d3.binding == "rebound" and (d3.stranded_blocks == 0 or d2.replica == other)


def test_session_of_removed_or_expired_replica_is_none(impl):
    r = make(impl, session_ttl=5.0)
    r.bind_session("s", "b", now=0.0)
    r.bind_session("t", "a", now=0.0)
    r.remove_replica("b")
    assert r.session("s", now=1.0) is None
    r.add_replica("b")
    assert r.session("s", now=1.0) is None  # a new replica under the same name
    assert r.session("t", now=4.9) == "a" and r.session("t", now=5.0) is None
    r.bind_session("t", "a", now=6.0)  # an expired entry: replaced, counted
    assert r.session("t", now=6.0) == "a"
    assert r.stats()["session_expirations"] >= 1


def test_bind_session_respects_table_bounds(impl):
    r = make(impl, max_sessions=2)
    for i, s in enumerate(["x", "y", "z"]):
        r.bind_session(s, "a", now=float(i))
    assert r.stats()["sessions"] == 2 and r.stats()["session_evictions"] == 1
    assert r.session("x", now=3.0) is None and r.session("z", now=3.0) == "a"


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.bind_session(None, "a"),
        lambda r: r.bind_session(3, "a"),
        lambda r: r.bind_session("s" * 70, "a"),
        lambda r: r.bind_session("s", "zz"),
        lambda r: r.bind_session("s", 1),
        lambda r: r.bind_session("s", "a", now=float("nan")),
        lambda r: r.bind_session("s", "a", now="1"),
        lambda r: r.session(None),
        lambda r: r.session("s" * 70),
        lambda r: r.session("s", now=float("inf")),
        lambda r: r.session("\ud800"),
    ],
)
def test_session_call_errors_change_nothing(call):
    def run(m):
        r = make(m, max_session_bytes=64)
        r.bind_session("k", "b", now=0.0)
        before = (r.stats(), r.session("k", now=0.0))
        try:
            call(r)
        finally:
            assert (r.stats(), r.session("k", now=0.0)) == before
        return None

    kind, _ = same(run)
    assert kind == "raise"


# -- observe_route ---------------------------------------------------------------------------


def index_state(router, index):
    return [sorted(index.held(router.replica_id(n)).tolist()) for n in router.replicas], index.stats()


@pytest.mark.parametrize("mode", ["approximate", "hybrid"])
@pytest.mark.parametrize("policy", ["ttft", "least_loaded"])
def test_observe_route_equals_own_insert(impl, mode, policy):
    """Router A routes a stream of prompts; router B (same config) only observes A's
    decisions: their indexes stay equal, and B's load, sessions and stats stay untouched."""
    cfg = dict(policy=policy, mode=mode, index_capacity=12, speculative_ttl=3.0)
    a, b = make(impl, **cfg), make(impl, **cfg)
    rng = np.random.default_rng(5)
    families = [prompt(i, 48) for i in range(3)]
    for step in range(40):
        p = families[rng.integers(3)][: int(rng.integers(4, 49))]
        t = step * 0.5
        d = a.route(p, session=f"s{step % 4}", now=t)
        got = b.observe_route(d.replica, impl.block_hashes(p, 4), now=t)
        assert got >= 0
        assert index_state(a, a.index) == index_state(b, b.index)
        if mode == "hybrid":
            assert index_state(a, a.speculative_index) == index_state(b, b.speculative_index)
    for n in NAMES:
        assert b.load(n) == make(impl, **cfg).load(n)
    assert b.stats() == make(impl, **cfg).stats()
    assert b.session("s0", now=20.0) is None


def test_observe_route_returns_blocks_newly_held(impl):
    r = make(impl)
    hs = impl.block_hashes(prompt(1), 4)
    assert r.observe_route("a", hs, now=0.0) == 8
    assert r.observe_route("a", hs, now=1.0) == 0
    assert r.observe_route("b", hs[:3], now=1.0) == 3
    assert r.index.match(hs).tolist()[:3] == [8, 3, 0]
    d = r.route(prompt(1), now=2.0)
    assert (d.replica, d.matched_blocks) == ("a", 8)


def test_observe_route_precise_is_a_no_op(impl):
    r = make(impl, mode="precise")
    before = index_state(r, r.index)
    assert r.observe_route("a", impl.block_hashes(prompt(1), 4), now=0.0) == 0
    assert index_state(r, r.index) == before


@pytest.mark.parametrize("mode", ["approximate", "hybrid", "precise"])
@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.observe_route("zz", [1, 2]),
        lambda r: r.observe_route(None, [1, 2]),
        lambda r: r.observe_route("a", [1, "x"]),
        lambda r: r.observe_route("a", np.zeros((2, 2), np.uint64)),
        lambda r: r.observe_route("a", [1.5]),
        lambda r: r.observe_route("a", [2**64]),
        lambda r: r.observe_route("a", [1, 2], now=float("nan")),
        lambda r: r.observe_route("a", [1, 2], now=True),
        lambda r: r.observe_route("a", [7, 2], now=0.5),  # block 2 exists after block 1: contradicts
    ],
)
def test_observe_route_errors_change_nothing(mode, call):
    def run(m):
        r = make(m, mode=mode)
        r.observe_route("a", [1, 2, 3], now=0.0)
        spec = r.speculative_index
        before = (index_state(r, r.index), spec and index_state(r, spec), r.stats())
        try:
            return call(r)
        finally:
            spec = r.speculative_index
            assert (index_state(r, r.index), spec and index_state(r, spec), r.stats()) == before

    same(run)


def test_two_routers_sharing_load_see_the_fleet(impl):
    """Gateways A and B alternate; after each change each publishes load(name)["own"] to
    the other as external: both then see the whole fleet's load, and least_loaded sends
    every request to the replica least loaded fleet-wide, not just by its own half."""
    a, b = make(impl, policy="least_loaded"), make(impl, policy="least_loaded")

    def publish(src, dst):
        for n in NAMES:
            dst.set_external_load(n, **src.load(n)["own"])

    def fleet():
        return [a.load(n)["own"]["in_flight"] + b.load(n)["own"]["in_flight"] for n in NAMES]

    handles: list[tuple] = []
    for i in range(30):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        before = fleet()
        d = src.route(prompt(i), now=float(i))
        assert before[NAMES.index(d.replica)] == min(before)
        handles.append((src, d))
        publish(src, dst)
        if i % 3 == 2:  # some finish, out of order
            old_src, old = handles.pop(len(handles) // 2)
            old_src.finish(old.handle)
            publish(old_src, b if old_src is a else a)
        totals = [counts(a.load(n)) for n in NAMES]
        assert totals == [counts(b.load(n)) for n in NAMES]
        assert [t["in_flight"] for t in totals] == fleet()
