"""External load is load (contract C6): a router told "replica r carries load X from other
routers" decides exactly like a router that carries load X on r itself.

Router P routes a random stream of requests and keeps them in flight (prefill_done and
finish come later, in random order). Router Q, same config and fleet, makes the same
routes but finishes each of its requests at once, and before every decision is given P's
own load as external load. Q's index, sessions, tie order and generator then evolve like
P's, and every load term any policy reads is equal, so every Decision must be equal, for
every policy. (Approximate mode, no capacity: ttft's pending cache, which P has and Q does
not, never adds to what the index holds there; precise mode: every policy but ttft.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import IMPLEMENTATIONS, load_impl
from kvroute.config import POLICY_PARAMS, RouterConfig

BS = 4
NAMES = ["r0", "r1", "r2", "r3"]
_RNG = np.random.default_rng(77)
FAMILIES = [_RNG.integers(0, 1000, 48).astype(np.uint32) for _ in range(3)]


def _fields(d) -> tuple:
    return (d.replica, d.replica_id, d.matched_blocks, d.cached_tokens, d.prompt_tokens, d.reason,
            d.binding, d.stranded_blocks, d.handle)  # fmt: skip


def _counts(load: dict) -> dict:
    return {k: v for k, v in load.items() if k not in ("own", "external")}


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("route"),
            st.integers(0, len(FAMILIES) - 1),
            st.integers(1, 48),
            st.sampled_from([None, "s0", "s1", "s2"]),
            st.sampled_from([0.0, 0.01, 0.5]),
        ),
        st.tuples(st.just("prefill"), st.integers(0, 20)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("report"), st.sampled_from(NAMES), st.integers(0, 9), st.sampled_from([0.0, 0.5, 0.9])),
        st.tuples(st.just("flip"), st.sampled_from(NAMES)),
    ),
    max_size=40,
)

CONFIGS = st.one_of(
    st.tuples(st.just("approximate"), st.sampled_from(sorted(POLICY_PARAMS))),
    st.tuples(st.just("precise"), st.sampled_from(sorted(set(POLICY_PARAMS) - {"ttft"}))),
)


@pytest.mark.parametrize("impl_name", IMPLEMENTATIONS)
@given(config=CONFIGS, seed=st.integers(0, 2**32), ops=OPS)
def test_external_load_decides_like_own_load(impl_name, config, seed, ops):
    impl = load_impl(impl_name)
    mode, policy = config
    cfg = RouterConfig(policy=policy, mode=mode, block_size=BS, seed=seed, session_saturation=1.5)
    p, q = impl.Router(cfg, NAMES), impl.Router(cfg, NAMES)
    in_flight: list[list] = []  # [handle, prefilled] of P's requests
    t = 0.0
    for op in ops:
        kind = op[0]
        if kind == "route":
            _, fam, n, session, dt = op
            t += dt
            for name in NAMES:
                q.set_external_load(name, **p.load(name)["own"])
                assert _counts(q.load(name)) == _counts(p.load(name))
            tokens = FAMILIES[fam][:n]
            dp = p.route(tokens, session=session, now=t)
            dq = q.route(tokens, session=session, now=t)
            assert _fields(dp) == _fields(dq)
            q.finish(dq.handle)
            in_flight.append([dp.handle, False])
        elif kind in ("prefill", "finish") and in_flight:
            entry = in_flight[op[1] % len(in_flight)]
            if kind == "finish":
                p.finish(entry[0])
                in_flight.remove(entry)
            elif not entry[1]:
                p.prefill_done(entry[0])
                entry[1] = True
        elif kind == "report":
            for r in (p, q):
                r.report_load(op[1], waiting=op[2], kv_usage=op[3])
        elif kind == "flip":
            healthy = not p.load(op[1])["healthy"]
            if healthy or sum(p.load(n)["healthy"] for n in NAMES) > 1:
                p.set_healthy(op[1], healthy)
                q.set_healthy(op[1], healthy)
    assert p.stats() | {"in_flight": 0} == q.stats() | {"in_flight": 0}


EXTERNAL = st.fixed_dictionaries(
    {k: st.sampled_from([0, 1, 3, 1000, 2**40]) for k in
     ("in_flight", "queued_prefill_tokens", "prefill_requests", "prefill_blocks", "decode_blocks")}
)  # fmt: skip


@given(
    config=CONFIGS,
    seed=st.integers(0, 2**32),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("route"), st.integers(0, len(FAMILIES) - 1), st.integers(1, 48),
                      st.sampled_from([None, "s0", "s1"])),
            st.tuples(st.just("external"), st.sampled_from(NAMES), EXTERNAL),
            st.tuples(st.just("bind"), st.sampled_from(["s0", "s1"]), st.sampled_from(NAMES)),
            st.tuples(st.just("observe"), st.sampled_from(NAMES), st.integers(0, len(FAMILIES) - 1),
                      st.integers(1, 48)),
            st.tuples(st.just("finish"), st.integers(0, 20)),
        ),
        max_size=30,
    ),
)
def test_native_and_reference_agree_with_shared_state(config, seed, steps):
    """The C6 calls, external loads up to the 2**40 bound included, on both
    implementations: the same decisions, loads and session bindings."""
    mode, policy = config
    cfg = RouterConfig(policy=policy, mode=mode, block_size=BS, seed=seed)
    routers = [load_impl(name).Router(cfg, NAMES) for name in IMPLEMENTATIONS]
    handles: list[int] = []
    for i, step in enumerate(steps):
        t = i * 0.1
        out = []
        for r in routers:
            kind = step[0]
            if kind == "route":
                out.append(_fields(r.route(FAMILIES[step[1]][: step[2]], session=step[3], now=t)))
            elif kind == "external":
                r.set_external_load(step[1], **step[2])
            elif kind == "bind":
                r.bind_session(step[1], step[2], now=t)
            elif kind == "observe":
                hashes = load_impl("reference").block_hashes(FAMILIES[step[2]][: step[3]], BS)
                out.append(r.observe_route(step[1], hashes, now=t))
            elif handles:
                r.finish(handles[step[1] % len(handles)])
            out.append([r.load(n) for n in NAMES])
            out.append([r.session(s, now=t) for s in ("s0", "s1")])
        assert out[: len(out) // 2] == out[len(out) // 2 :]
        if step[0] == "route":
            handles.append(out[0][-1])
        elif step[0] == "finish" and handles:
            handles.pop(step[1] % len(handles))
