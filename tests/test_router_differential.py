"""Native and reference Routers driven by the same random call sequences must agree exactly.

A hypothesis state machine builds one router per implementation with a random policy,
parameters, index mode and fleet, then applies random routes (with sessions, shared
prefixes and advancing time), lifecycle calls (valid, repeated and bogus handles),
drains, health flips, removals, re-additions and load reports. After every step both
must have returned the same Decision (or raised the same error) and report the same
loads and stats; and the loads must equal what a naive model recomputes from the
requests in flight.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import load_impl
from kvroute.config import POLICY_PARAMS, RouterConfig

NATIVE = load_impl("native")
REFERENCE = load_impl("reference")
BS = 4
NAMES = [f"r{i}" for i in range(8)]

# Prompt families share leading blocks, so matches, affinity and load fallbacks all occur.
_RNG = np.random.default_rng(1234)
FAMILIES = [_RNG.integers(0, 1000, 64).astype(np.int32) for _ in range(4)]

MIN_MATCH = st.sampled_from([0, 8, 32, 256])
PARAMS = {
    "sticky": st.fixed_dictionaries({"vnodes": st.sampled_from([1, 8, 64]), "bound": st.sampled_from([None, 1.0, 1.5])}),
    "linear": st.fixed_dictionaries(
        {
            "min_match_tokens": MIN_MATCH,
            "escape_factor": st.sampled_from([1.0, 1.5, 3.0]),
            "w_load": st.sampled_from([0.0, 0.5, 1.0]),
        }
    ),
    "sglang": st.fixed_dictionaries(
        {
            "balance_abs_threshold": st.sampled_from([0, 1, 64]),
            "balance_rel_threshold": st.sampled_from([1.0, 1.5]),
            "cache_threshold": st.sampled_from([0.0, 0.3, 0.9]),
            "min_match_tokens": MIN_MATCH,
        }
    ),
    "dynamo": st.fixed_dictionaries(
        {
            "temperature": st.sampled_from([0.0, 0.3, 2.0]),
            "prefill_load_scale": st.sampled_from([0.5, 1.0]),
            "min_match_tokens": MIN_MATCH,
        }
    ),
    "llmd": st.fixed_dictionaries({"w_kv": st.sampled_from([0.0, 2.0]), "min_match_tokens": MIN_MATCH}),
    "preble": st.fixed_dictionaries({"decode_weight": st.sampled_from([0.0, 32.0]), "min_match_tokens": MIN_MATCH}),
    "ttft": st.fixed_dictionaries({"min_match_tokens": MIN_MATCH}),
}


def call(fn):
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return ("raise", type(exc).__name__, str(exc))
    if hasattr(value, "handle"):
        value = (
            value.replica,
            value.replica_id,
            value.matched_blocks,
            value.cached_tokens,
            value.prompt_tokens,
            value.reason,
            value.binding,
            value.stranded_blocks,
            value.handle,
        )
    return ("ok", value)


class RouterPair(RuleBasedStateMachine):
    """Both implementations plus a naive model of the load accounting."""

    @initialize(
        policy=st.sampled_from(list(POLICY_PARAMS)),
        data=st.data(),
        mode=st.sampled_from(["approximate", "precise", "hybrid"]),
        n=st.integers(1, 5),
        capacity=st.sampled_from([None, 6]),
        ttl=st.sampled_from([None, 5.0]),
        seed=st.integers(0, 2**64 - 1),
        request_ttl=st.sampled_from([7.0, 3600.0]),
        session_bytes=st.sampled_from([4, 1 << 20]),
    )
    def setup(self, policy, data, mode, n, capacity, ttl, seed, request_ttl, session_bytes):
        params = data.draw(PARAMS[policy]) if policy in PARAMS else {}
        cfg = RouterConfig(
            policy=policy,
            params=params,
            block_size=BS,
            mode=mode,
            index_capacity=capacity,
            index_ttl=ttl,
            speculative_ttl=3.0,
            session_ttl=10.0,
            max_sessions=3,
            seed=seed,
            session_saturation=1.5,
            request_ttl=request_ttl,
            max_session_bytes=session_bytes,
        )
        self.routers = [NATIVE.Router(cfg, NAMES[:n]), REFERENCE.Router(cfg, NAMES[:n])]
        self.live = list(NAMES[:n])
        self.t = 0.0
        self.issued = 0
        self.request_ttl = request_ttl
        self.model: dict[int, dict] = {}  # handle -> request, for the load recomputation

    def both(self, fn):
        got = [call(lambda r=r: fn(r)) for r in self.routers]
        assert got[0] == got[1], f"native {got[0]!r} != reference {got[1]!r}"
        return got[0]

    @rule(
        family=st.integers(0, 3),
        keep=st.integers(0, 64),
        extra=st.integers(0, 12),
        session=st.sampled_from([None, None, "s0", "s1", "s2", "s3", "s4"]),
        dt=st.sampled_from([0.0, 0.5, 2.0, 6.0]),
    )
    def route(self, family, keep, extra, session, dt):
        self.t += dt
        tokens = np.concatenate([FAMILIES[family][:keep], np.arange(2000 + extra, 2000 + 2 * extra, dtype=np.int32)])
        got = self.both(lambda r: r.route(tokens, session=session, now=self.t))
        self.record(got)

    @rule(family=st.integers(0, 3), n=st.integers(0, 6), slack=st.integers(0, 3))
    def route_hashes(self, family, n, slack):
        hashes = [family * 1000 + k for k in range(n)]
        got = self.both(lambda r: r.route_hashes(hashes, n * BS - slack if n else 0, now=self.t))
        self.record(got)

    def record(self, got):
        if got[0] != "ok":
            return
        # Requests routed request_ttl ago or more were released before this decision.
        for h in [h for h, q in self.model.items() if q["at"] + self.request_ttl <= self.t]:
            del self.model[h]
        name, _, _, cached, tokens, _, _, _, handle = got[1]
        self.issued = handle
        self.model[handle] = {"replica": name, "uncached": tokens - cached, "prefilled": False, "at": self.t}

    @precondition(lambda self: self.issued > 0)
    @rule(pick=st.integers(0, 1000), bogus=st.sampled_from([False, False, False, True]))
    def prefill_done(self, pick, bogus):
        h = -pick if bogus else 1 + pick % self.issued
        got = self.both(lambda r: r.prefill_done(h, now=self.t))
        if got[0] == "ok" and h in self.model and self.model[h]["replica"] is not None:
            self.model[h]["prefilled"] = True

    @precondition(lambda self: self.issued > 0)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick):
        h = 1 + pick % (self.issued + 1)
        got = self.both(lambda r: r.finish(h))
        if got[0] == "ok":
            del self.model[h]

    @rule(name=st.sampled_from(NAMES), flag=st.booleans())
    def drain(self, name, flag):
        self.both(lambda r: r.drain(name, flag))

    @rule(name=st.sampled_from(NAMES), flag=st.booleans())
    def set_healthy(self, name, flag):
        self.both(lambda r: r.set_healthy(name, flag))

    @rule(name=st.sampled_from(NAMES))
    def remove_replica(self, name):
        got = self.both(lambda r: r.remove_replica(name))
        if got[0] == "ok":
            self.live.remove(name)
            for req in self.model.values():
                if req["replica"] == name:
                    req["replica"] = None

    @rule(name=st.sampled_from(NAMES), engine_block=st.sampled_from([None, None, 2, 4, 8, 12]))
    def add_replica(self, name, engine_block):
        got = self.both(lambda r: r.add_replica(name, engine_block_size=engine_block))
        if got[0] == "ok":
            self.live.append(name)

    @precondition(lambda self: self.routers[0].index.num_replicas < 12)
    @rule()
    def add_index_id_directly(self):
        self.both(lambda r: r.index.add_replica())

    @rule(
        name=st.sampled_from(NAMES),
        waiting=st.sampled_from([None, 0, 3, -1]),
        kv=st.sampled_from([None, 0.0, 0.5, 0.95, 2.0]),
    )
    def report_load(self, name, waiting, kv):
        self.both(lambda r: r.report_load(name, waiting=waiting, kv_usage=kv))

    @invariant()
    def same_state(self):
        if not hasattr(self, "routers"):
            return
        self.both(lambda r: r.stats())
        self.both(lambda r: r.replicas)
        self.both(lambda r: r.index.match(np.array([], dtype=np.uint64)).tolist())
        for name in self.live:
            load = self.both(lambda r: r.load(name))[1]
            mine = [q for q in self.model.values() if q["replica"] == name]
            assert load["in_flight"] == len(mine)
            assert load["queued_prefill_tokens"] == sum(q["uncached"] for q in mine if not q["prefilled"])
            assert load["prefill_requests"] == sum(not q["prefilled"] for q in mine)
            assert load["decode_blocks"] >= 0 and load["prefill_blocks"] >= 0
        assert self.both(lambda r: r.stats()["in_flight"])[1] == len(self.model)


TestRouterDifferential = RouterPair.TestCase


def test_every_policy_has_a_twin_in_both():
    from kvroute.reference.policies import POLICIES

    assert list(POLICIES) == list(POLICY_PARAMS)
    for policy in POLICY_PARAMS:  # the native factory knows every name (else ValueError)
        assert NATIVE.Router(RouterConfig(policy=policy), ["a"]).route_hashes([1], 16).replica == "a"
