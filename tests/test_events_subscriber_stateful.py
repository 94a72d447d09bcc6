"""A simulated engine (router and engine block size 16) publishing through a loopback
publisher that loses batches, restarts (new process, new connection, numbers from 0) and
answers replays with holes, followed by a real Subscriber. After every step, once the
subscriber has caught up with the publisher's last number and a probe has confirmed it:

- kvroute never claims a block the engine does not hold, nor matches any prompt served so
  far beyond what the engine would reuse, and
- its match equals what the engine's events imply under the applier's duplicate rule
  (kv_wire.Engine.reuse(claimed=True)) unless history was lost (a resync) since the last
  point both were known empty (an applied cache reset, or a restart replayed from 0).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

zmq = pytest.importorskip("zmq")

from kv_wire import FORMATS, Engine, batch  # noqa: E402
from zmq_pub import Publisher, new_applier, wait_until, warm_up  # noqa: E402

import kvroute.reference as R  # noqa: E402
from kvroute.events import Source, Subscriber  # noqa: E402

BS = 16
BASES = [[1000 * (b + 1) + i for i in range(96)] for b in range(3)]
REQUEST = st.tuples(st.integers(0, 2), st.integers(0, 6), st.lists(st.integers(0, 2), max_size=40))


class SubscriberFollowsEngine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = zmq.Context()
        self.pub = self.sub = None

    @initialize(fmt=st.sampled_from(FORMATS), layout=st.sampled_from(["new", "old"]),
                ring=st.integers(2, 10), capacity=st.integers(3, 12),
                impl=st.sampled_from(["native", "reference"]))
    def setup(self, fmt, layout, ring, capacity, impl):
        self.fmt, self.capacity = fmt, capacity
        self.pub = Publisher(self.ctx, replay=layout, buffer_steps=ring)
        self.eng = Engine(fmt, capacity, BS, BS)
        self.idx, applier = new_applier(impl, replicas=1)
        self.sub = Subscriber(applier, [Source(0, self.pub.endpoint, self.pub.replay_endpoint)],
                              replay_timeout=0.3, replay_attempts=2, probe_interval=0.02).start()
        warm_up(self.pub, self.sub, 0)
        self.exact, self.reset, self.ts = True, False, 0.0
        self.probes: list[list[int]] = []
        self.resyncs = self._status()["resyncs"]

    def teardown(self) -> None:
        if self.sub is not None:
            self.sub.stop()
        if self.pub is not None:
            self.pub.close()
        self.ctx.term()

    def _status(self):
        return self.sub.status()["replicas"][0]

    def _prompt(self, req):
        b, keep, tail = req
        tokens = BASES[b][: keep * BS] + tail
        if tokens not in self.probes:
            self.probes = (self.probes + [tokens])[-12:]
        return tokens

    def _publish(self, events, lost):
        # Engines stamp each batch with the time: two processes' batches never match bytes.
        self.ts += 1.0
        self.pub.publish(batch(events, ts=self.ts), send=not lost)

    @rule(req=REQUEST, lost=st.booleans())
    def serve(self, req, lost):
        self._publish(self.eng.serve(self._prompt(req)), lost)

    @rule(reqs=st.lists(REQUEST, min_size=2, max_size=3), lost=st.booleans())
    def step_of_several_requests(self, reqs, lost):
        self._publish(self.eng.step([self._prompt(r) for r in reqs]), lost)

    @rule(lost=st.booleans())
    def reset_prefix_cache(self, lost):
        self._publish(self.eng.clear(), lost)
        self.reset = True

    @rule(first=st.lists(REQUEST, max_size=3))
    def restart(self, first):
        """A new process: empty cache, numbers from 0, a new connection that loses what is
        sent before it is made; its first batches are lost here besides."""
        self.pub.restart(rebind=True)
        self.eng = Engine(self.fmt, self.capacity, BS, BS)
        for req in first:
            self._publish(self.eng.serve(self._prompt(req)), True)
        self.reset = True

    @rule(holes=st.sets(st.integers(0, 8), min_size=1, max_size=3), rounds=st.integers(1, 3))
    def next_replays_lose_replies(self, holes, rounds):
        """The next replay rounds lose these numbers (counted back from the newest)."""
        top = self.pub.seq - 1
        self.pub.drops = [{top - h for h in holes}] * rounds

    def _caught_up(self, probes):
        st_ = self._status()
        return (st_["last_seq"] == self.pub.seq - 1 and st_["probes"] > probes
                and not st_["replaying"] and st_["buffered_batches"] == 0)

    @invariant()
    def follows_the_engine(self):
        if self.sub is None:
            return
        # Caught up: at the publisher's last number, with a whole probe begun after it (the
        # probe checks the last number's bytes, so a restart cannot pass unseen).
        probes = self._status()["probes"] + (1 if self._status()["replaying"] else 0)
        assert wait_until(lambda: self._caught_up(probes)), (self._status(), self.pub.seq)
        resyncs = self._status()["resyncs"]
        if resyncs > self.resyncs:
            self.exact = False
        elif self.reset:
            self.exact = True
        self.resyncs, self.reset = resyncs, False
        held, truth = set(self.idx.held(0).tolist()), set(self.eng.truth())
        assert held <= truth, f"claims {len(held - truth)} blocks the engine does not hold"
        for probe in self.probes + [b[:96] for b in BASES]:
            got = int(self.idx.match(R.block_hashes(probe, BS))[0])
            assert got <= self.eng.reuse(probe)
            if self.exact:
                # What the applier's duplicate rule keeps (kv_wire.Engine.reuse(claimed=True)).
                assert got == self.eng.reuse(probe, claimed=True), (probe, self._status())

# Each step waits for a real probe over loopback: a sixteenth of the profile's examples
# (ci: 12, about 7 s; thorough: 250).
SubscriberFollowsEngine.TestCase.settings = settings(
    max_examples=max(2, settings.default.max_examples // 16), stateful_step_count=12, deadline=None)
test_subscriber_follows_engine = pytest.mark.slow(SubscriberFollowsEngine.TestCase)
