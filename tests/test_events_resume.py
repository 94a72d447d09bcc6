"""Subscriber resume from saved cursors (contract C8), against real loopback publishers.

A first Subscriber follows an engine and stops (the gateway goes down); its applier keeps
the state it had, as a restored snapshot would, and Subscriber.cursors() is what was saved
with it. While nobody listens the engine goes on (its batches reach only the replay ring),
including evictions of blocks stored before the snapshot. A second Subscriber on the same
applier, resumed from the cursors, must then continue exactly (ring still holds the
anchor), or clear the replica and count one resync (ring lost the anchor, engine
restarted so the anchor's bytes differ, no replay endpoint)."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")

from kv_wire import Engine, batch  # noqa: E402
from zmq_pub import WAIT, ctx, new_applier, pubs, warm_up  # noqa: E402, F401

from kvroute._follow import digest  # noqa: E402
from kvroute.events import Source, Subscriber  # noqa: E402

R = 1
PROMPTS = [list(range(1000 * i, 1000 * i + 64)) for i in range(1, 8)]  # 4 blocks each


class Feed:
    """One engine (4 blocks of capacity: every prompt evicts the previous one) publishing
    through `pub`; each batch carries its own timestamp, so two processes never send the
    same bytes."""

    def __init__(self, pub, ts0=1.0):
        self.pub, self.eng, self.ts = pub, Engine("vllm-array", 4, 16, 16), ts0

    def serve(self, prompt, *, send=True):
        self.ts += 1.0
        return self.pub.publish(batch(self.eng.serve(prompt), ts=self.ts), send=send)


def first_life(pub, applier, impl_name):
    """Follow the engine through two prompts, stop; returns (feed, cursors, index blocks)."""
    feed = Feed(pub)
    with Subscriber(applier, [Source(R, pub.endpoint, pub.replay_endpoint)]) as sub:
        assert sub.cursors() == {}
        warm_up(pub, sub, R)
        feed.serve(PROMPTS[0])
        last = feed.serve(PROMPTS[1])
        assert sub.wait_for_seq(R, last, timeout=WAIT, settled=True)
        cursors = sub.cursors()
    with pub.lock:
        payload = dict(pub.ring)[last]
    assert cursors == {R: {"seq": last, "digest": digest(payload)}}
    return feed, cursors


def resumed(pub, applier, cursors, replay=True, **kw):
    src = Source(R, pub.endpoint, pub.replay_endpoint if replay else None)
    return Subscriber(applier, [src], resume=cursors, replay_timeout=0.5, **kw)


@pytest.mark.parametrize("impl_name", ["native", "reference"])
@pytest.mark.parametrize("layout", ["new", "old"])
def test_ring_holds_the_anchor_state_continues(pubs, impl_name, layout):
    pub = pubs(replay=layout)
    idx, applier = new_applier(impl_name)
    feed, cursors = first_life(pub, applier, impl_name)
    truth_at_snapshot = feed.eng.truth()
    assert idx.held(R).tolist() == truth_at_snapshot
    # Down: the engine serves two more prompts (evicting the snapshot's blocks) unheard.
    feed.serve(PROMPTS[2], send=False)
    feed.serve(PROMPTS[3], send=False)
    assert not set(feed.eng.truth()) & set(truth_at_snapshot)
    with resumed(pub, applier, cursors) as sub:
        last = feed.serve(PROMPTS[4])
        assert sub.wait_for_seq(R, last, timeout=WAIT, settled=True)
        st = sub.status()["replicas"][R]
        assert (st["resyncs"], st["restarts"], st["replays"]) == (0, 0, 1)
        assert st["replayed_batches"] >= 2
        # The removals of blocks stored before the snapshot resolved: exactly the engine.
        assert idx.held(R).tolist() == feed.eng.truth()
        with pub.lock:
            payload = dict(pub.ring)[last]
        assert sub.cursors() == {R: {"seq": last, "digest": digest(payload)}}
        with sub.paused() as held:
            assert held == sub.cursors()


@pytest.mark.parametrize("impl_name", ["native", "reference"])
def test_ring_lost_the_anchor_clears(pubs, impl_name):
    pub = pubs(replay="new", buffer_steps=2)
    idx, applier = new_applier(impl_name)
    feed, cursors = first_life(pub, applier, impl_name)
    for p in PROMPTS[2:5]:
        feed.serve(p, send=False)  # the ring keeps the last 2: the anchor is gone
    with resumed(pub, applier, cursors) as sub:
        last = feed.serve(PROMPTS[5])
        assert sub.wait_for_seq(R, last, timeout=WAIT, settled=True)
        st = sub.status()["replicas"][R]
        assert (st["resyncs"], st["restarts"]) == (1, 0)
        held = set(idx.held(R).tolist())
        assert held <= set(feed.eng.truth())  # never more than the engine holds
        # Followed from the ring's first batch on: the last two prompts are known.
        assert held == set(feed.eng.truth())


@pytest.mark.parametrize("impl_name", ["native", "reference"])
@pytest.mark.parametrize("batches_after_restart", [1, 6])
def test_engine_restarted_clears(pubs, impl_name, batches_after_restart):
    """The engine restarted while the gateway was down: numbers from 0 again; the batch
    numbered like the anchor either differs in bytes (6 batches) or does not exist yet (1)."""
    pub = pubs(replay="new")
    idx, applier = new_applier(impl_name)
    feed, cursors = first_life(pub, applier, impl_name)
    pub.restart()
    feed = Feed(pub, ts0=500.0)
    for i in range(batches_after_restart):
        feed.serve(PROMPTS[2 + i % 5], send=False)
    with resumed(pub, applier, cursors) as sub:
        last = feed.serve(PROMPTS[0])
        assert sub.wait_for_seq(R, last, timeout=WAIT, settled=True)
        st = sub.status()["replicas"][R]
        assert (st["resyncs"], st["restarts"]) == (1, 0)
        # Cleared, then the new process followed from 0 (its ring holds all of it).
        assert idx.held(R).tolist() == feed.eng.truth()


@pytest.mark.parametrize("impl_name", ["native", "reference"])
def test_no_replay_endpoint_clears(pubs, impl_name):
    pub = pubs(replay="new")
    idx, applier = new_applier(impl_name)
    feed, cursors = first_life(pub, applier, impl_name)
    assert idx.blocks(R) > 0
    with resumed(pub, applier, cursors, replay=False) as sub:
        assert sub.status()["replicas"][R]["resyncs"] == 1
        assert sub.cursors() == {}
        warm_up(pub, sub, R)
        assert idx.blocks(R) == 0
        last = feed.serve(PROMPTS[2])
        assert sub.wait_for_seq(R, last, timeout=WAIT)
        assert sub.status()["replicas"][R]["resyncs"] == 1
        assert set(idx.held(R).tolist()) <= set(feed.eng.truth())


@pytest.mark.parametrize(
    ("resume", "error"),
    [
        ([(1, {"seq": 0, "digest": 0})], "TypeError"),
        ({2: {"seq": 0, "digest": 0}}, "ValueError"),
        ({1: (0, 0)}, "TypeError"),
        ({1: {"seq": 0}}, "ValueError"),
        ({1: {"seq": -1, "digest": 0}}, "ValueError"),
        ({1: {"seq": 0, "digest": 2**64}}, "ValueError"),
        ({1: {"seq": True, "digest": 0}}, "TypeError"),
        ({1: {"seq": 0, "digest": 1.0}}, "TypeError"),
    ],
)
def test_resume_argument_errors(resume, error):
    _, applier = new_applier("reference")
    with pytest.raises(Exception) as info:
        Subscriber(applier, [Source(1, "tcp://127.0.0.1:1")], resume=resume)
    assert type(info.value).__name__ == error
    assert "resume" in str(info.value)
