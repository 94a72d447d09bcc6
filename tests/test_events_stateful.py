"""Random engine event streams: two simulated engines (LRU block caches, kv_wire.Engine) emit
their events; after every batch each implementation's index must hold no block the engine
does not cache, answer every prompt served so far exactly as the duplicate rule implies
(kv_wire.Engine.reuse(claimed=True): blocks whose last event was a store) and never above
what the engine would reuse, and both implementations must agree on every counter."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conftest import load_impl
from kv_wire import FORMATS, Engine, batch

BS = 16
BASES = [[1000 * (b + 1) + i for i in range(96)] for b in range(3)]


class EngineStreams(RuleBasedStateMachine):
    @initialize(
        fmts=st.lists(st.sampled_from(FORMATS), min_size=2, max_size=2),
        sizes=st.lists(st.sampled_from([16, 32]), min_size=2, max_size=2),
        styles=st.lists(st.sampled_from(["uint", "int", "bytes"]), min_size=2, max_size=2),
        capacity=st.integers(3, 12),
        salt=st.sampled_from([None, "s"]),
    )
    def setup(self, fmts, sizes, styles, capacity, salt):
        self.engines = [Engine(f, capacity, s, BS, salt, hs) for f, s, hs in zip(fmts, sizes, styles)]
        self.salt = salt
        self.impls = []
        for name in ("native", "reference"):
            M = load_impl(name)
            idx = M.PrefixIndex(2)
            self.impls.append((idx, M.EventApplier(idx, BS, salt=salt)))
        self.ts = 0.0
        self.probes: list[list[int]] = []

    def _send(self, r, events):
        self.ts += 1.0
        payload = batch(events, ts=self.ts)
        got = [a.apply(r, payload) for _, a in self.impls]
        assert got == [True, True]

    def _request(self, base, keep, tail):
        tokens = BASES[base][: keep * 16] + tail
        if tokens not in self.probes:
            self.probes = (self.probes + [tokens])[-6:]
        return tokens

    @rule(r=st.integers(0, 1), base=st.integers(0, 2), keep=st.integers(0, 6),
          tail=st.lists(st.integers(0, 2), max_size=40))
    def serve(self, r, base, keep, tail):
        self._send(r, self.engines[r].serve(self._request(base, keep, tail)))

    @rule(r=st.integers(0, 1), reqs=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 6), st.lists(st.integers(0, 2), max_size=40)),
        min_size=2, max_size=3))
    def step_of_several_requests(self, r, reqs):
        self._send(r, self.engines[r].step([self._request(b, k, t) for b, k, t in reqs]))

    @rule(r=st.integers(0, 1))
    def reset_prefix_cache(self, r):
        self._send(r, self.engines[r].clear())

    @rule(r=st.integers(0, 1), junk=st.binary(max_size=30))
    def malformed_payload(self, r, junk):
        payload = b"\x93\xcb" + junk  # starts like a batch, then garbage
        got = [a.apply(r, payload) for _, a in self.impls]
        assert got[0] == got[1]

    @invariant()
    def index_equals_engine(self):
        if not hasattr(self, "engines"):
            return
        for r, eng in enumerate(self.engines):
            truth = set(eng.truth())
            for idx, _ in self.impls:
                assert set(idx.held(r).tolist()) <= truth
            for probe in self.probes + [b[:96] for b in BASES]:
                hashes = load_impl("reference").block_hashes(probe, BS, salt=self.salt)
                want = eng.reuse(probe, claimed=True)
                assert want <= eng.reuse(probe)
                for idx, _ in self.impls:
                    assert idx.match(hashes)[r] == want
        (ni, na), (ri, ra) = self.impls
        assert na.stats() == ra.stats()
        for r in range(2):
            assert na.replica_stats(r) == ra.replica_stats(r)
        ni.check_invariants()


TestEngineStreams = EngineStreams.TestCase
# Each step runs both implementations and rebuilds the engine's truth; half the profile's
# examples keep this file near 30 s under `ci` (thorough still scales it up 20x).
TestEngineStreams.settings = settings(settings.default, max_examples=max(10, settings.default.max_examples // 2))
