"""ttft's pending cache: prompts routed but before their first token count as cached on
their replica for the prompts queued behind them (a request behind its twin on the same
FIFO replica will hit). Examples per implementation, plus a state machine that checks
every ttft decision against a naive model (lists of open requests, LCP by hand).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import load_impl
from kvroute.config import RouterConfig

BS = 4
NAMES = ("a", "b", "c")


def make(impl, policy="ttft", names=NAMES, mode="precise"):
    # min_match_tokens 0: these prompts are a few blocks long; the pending cache is the subject.
    cfg = RouterConfig(policy=policy, params={"min_match_tokens": 0}, block_size=BS, mode=mode)
    return impl.Router(cfg, list(names))


def chain(family: int, n: int, tail: int = 0) -> list[int]:
    """n block hashes: the family's first n - (tail > 0) blocks, then a tail-specific one."""
    out = [1000 * family + i + 1 for i in range(n)]
    if tail and n:
        out[-1] = 10**9 + 1000 * family + tail
    return out


def test_twin_queued_behind_counts_as_cached(impl):
    r = make(impl)
    h = chain(1, 8)
    d1 = r.route_hashes(h, 8 * BS, now=0.0)
    assert (d1.matched_blocks, d1.reason) == (0, "miss")
    d2 = r.route_hashes(h, 8 * BS, now=0.0)
    assert (d2.replica, d2.matched_blocks, d2.cached_tokens, d2.reason) == (d1.replica, 8, 8 * BS, "affinity")
    # The twin adds no queued prefill: its blocks are written by the first request.
    assert r.load(d1.replica)["queued_prefill_tokens"] == 8 * BS
    # A prompt sharing 5 leading blocks matches 5 of them.
    d3 = r.route_hashes(chain(1, 9, tail=7)[:5] + [77, 78], 7 * BS, now=0.0)
    assert (d3.replica, d3.matched_blocks) == (d1.replica, 5)


def test_other_policies_do_not_count_pending(impl):
    r = make(impl, policy="preble")
    h = chain(1, 8)
    r.route_hashes(h, 8 * BS, now=0.0)
    assert r.route_hashes(h, 8 * BS, now=0.0).matched_blocks == 0


def test_released_at_prefill_done_finish_and_removal(impl):
    h = chain(2, 6)
    for release in ("prefill_done", "finish", "remove"):
        r = make(impl)
        d = r.route_hashes(h, 6 * BS, now=0.0)
        if release == "remove":
            r.remove_replica(d.replica)
            r.add_replica(d.replica)
        else:
            getattr(r, release)(d.handle)
        # Precise mode and no events: nothing is cached and nothing is pending any more.
        assert r.route_hashes(h, 6 * BS, now=0.0).matched_blocks == 0, release


def test_misuse_leaves_pending_unchanged(impl):
    r = make(impl)
    d = r.route_hashes(chain(3, 4), 4 * BS, now=0.0)
    r.prefill_done(d.handle)
    try:
        r.prefill_done(d.handle)
    except RuntimeError as exc:
        assert str(exc) == f"request {d.handle} already reported its first token"
    d2 = r.route_hashes(chain(3, 4), 4 * BS, now=0.0)
    assert d2.matched_blocks == 0
    r.finish(d2.handle)
    r.finish(d.handle)
    assert r.stats()["in_flight"] == 0


class PendingMachine(RuleBasedStateMachine):
    """ttft in precise mode with no events: the only cache it may see is pending prompts."""

    impl_name = "native"

    def __init__(self) -> None:
        super().__init__()
        self.r = make(load_impl(self.impl_name))
        self.live = set(NAMES)
        # handle -> [replica, hashes, uncached tokens, prefilled]
        self.open: dict[int, list] = {}

    def expected_match(self, name: str, hashes: list[int]) -> int:
        best = 0
        for rep, other, _, prefilled in self.open.values():
            if rep != name or prefilled:
                continue
            k = 0
            while k < len(other) and k < len(hashes) and other[k] == hashes[k]:
                k += 1
            best = max(best, k)
        return best

    def queued(self, name: str) -> int:
        return sum(u for rep, _, u, pre in self.open.values() if rep == name and not pre)

    def inflight(self, name: str) -> int:
        return sum(1 for rep, *_ in self.open.values() if rep == name)

    @precondition(lambda self: self.live)
    @rule(family=st.integers(0, 2), n=st.integers(0, 6), tail=st.integers(0, 3), extra=st.integers(0, BS - 1))
    def route(self, family, n, tail, extra):
        hashes = chain(family, n, tail)
        tokens = n * BS - (extra if n else 0)
        keys = {}
        uncached = {n: tokens - min(self.expected_match(n, hashes) * BS, tokens) for n in self.live}
        least = min(uncached.values())
        p = RouterConfig(policy="ttft").params
        for name in self.live:
            m = self.expected_match(name, hashes)
            u = uncached[name]
            # kvroute.config's ttft estimate: decodes are the prefilled open requests.
            w = self.queued(name) + u
            done = [v for v in self.open.values() if v[0] == name and v[3]]
            cap = max(p["batch_tokens"] - len(done), 1)
            steps = max(1, (w + cap - 1) // cap)
            kv = float(sum(len(v[1]) for v in done) * BS)
            cost = float(w) + float(steps) * (float(len(done)) + p["step_tokens"] + p["kv_weight"] * kv) + \
                p["fleet_weight"] * float(u - least)
            keys[name] = (cost, -m, self.inflight(name))
        d = self.r.route_hashes(hashes, tokens, now=0.0)
        assert d.replica in self.live
        assert keys[d.replica] == min(keys.values()), (d, keys)
        m = self.expected_match(d.replica, hashes)
        assert d.matched_blocks == m
        assert d.cached_tokens == min(m * BS, tokens)
        self.open[d.handle] = [d.replica, hashes, tokens - d.cached_tokens, False]

    @precondition(lambda self: any(not v[3] for v in self.open.values()))
    @rule(data=st.data())
    def prefill_done(self, data):
        h = data.draw(st.sampled_from(sorted(k for k, v in self.open.items() if not v[3])))
        self.r.prefill_done(h)
        self.open[h][3] = True

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish(self, data):
        h = data.draw(st.sampled_from(sorted(self.open)))
        self.r.finish(h)
        del self.open[h]

    @precondition(lambda self: len(self.live) > 1)
    @rule(data=st.data())
    def remove_and_readd(self, data):
        name = data.draw(st.sampled_from(sorted(self.live)))
        self.r.remove_replica(name)
        for h in [h for h, v in self.open.items() if v[0] == name]:
            del self.open[h]  # released: their later lifecycle calls are no-ops
            self.r.finish(h)
        self.r.add_replica(name)

    @invariant()
    def loads_match(self):
        for name in self.live:
            load = self.r.load(name)
            assert load["queued_prefill_tokens"] == self.queued(name)
            assert load["in_flight"] == self.inflight(name)


class PendingMachineReference(PendingMachine):
    impl_name = "reference"


TestPendingNative = PendingMachine.TestCase
TestPendingReference = PendingMachineReference.TestCase
