"""The subscriber's sequence rules against loopback publishers that lose what real ones lose
(kv-events.md D; tests/zmq_pub.py scripts the losses so that every run is the same):
restarts whose first batches never arrive, replays with holes applied as they stream and
asked again, tail loss found by a probe, a replay that never ends, and the cap on what is
held. After each scenario the index must hold what the simulated engine caches (or, after
history was lost, nothing it does not). Every wait is bounded."""

from __future__ import annotations

import threading

import pytest

zmq = pytest.importorskip("zmq")

from kv_wire import Engine, batch  # noqa: E402
from zmq_pub import WAIT, ctx, delta, new_applier, pubs, send, wait_until, warm_up  # noqa: E402, F401

from kvroute.events import Source, Subscriber  # noqa: E402

BASE = list(range(5000, 5000 + 128))


def prompt(i: int, n: int = 64) -> list[int]:
    """A prompt of n tokens that shares nothing with prompt(j) for j != i."""
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def engine(fmt="vllm-map", capacity=64, ebs=16):
    return Engine(fmt, capacity=capacity, engine_block_size=ebs, block_size=16)


def status(sub, r=0):
    return sub.status()["replicas"][r]


def settle(sub, r, seq, **more):
    """Wait until replica r has applied `seq`, no replay is in flight and nothing is held,
    and every counter in `more` has reached at least the given value."""
    def done():
        st = status(sub, r)
        return (sub.wait_for_seq(r, seq, 0, settled=True)
                and all(st[k] >= v for k, v in more.items()))
    assert wait_until(done), status(sub, r)


def follow(pub, **kw):
    kw.setdefault("probe_interval", None)
    idx, applier = new_applier()
    return idx, Subscriber(applier, [Source(0, pub.endpoint, pub.replay_endpoint)], **kw)


# -- restarts -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["new", "old"])
def test_restart_whose_first_batches_are_lost(pubs, layout):
    """Issue 9 case 2: the new process's numbers are below the last applied, its first
    batches never arrive. The old process's blocks must go; the new one's are replayed."""
    pub = pubs(replay=layout)
    eng = engine("sglang" if layout == "old" else "vllm-map")
    idx, sub = follow(pub)
    with sub:
        warm_up(pub, sub, 0)
        for i in range(3):
            send(pub, sub, 0, eng.serve(prompt(i)))
        assert idx.held(0).tolist() == eng.truth() != []
        base = status(sub)
        pub.restart()
        eng = engine("sglang" if layout == "old" else "vllm-map")
        pub.publish(batch(eng.serve(prompt(7))), send=False)
        pub.publish(batch(eng.serve(prompt(7, 96))), send=False)
        seq = pub.publish(batch(eng.serve(prompt(8))))
        assert seq == 2
        settle(sub, 0, seq, restarts=base["restarts"] + 1)
        assert idx.held(0).tolist() == eng.truth()
        d = delta(sub, 0, base)
        assert d["restarts"] == 1 and d["resyncs"] == 0 and pub.requests[-1] == 0


def test_restart_whose_numbers_pass_the_old_ones(pubs):
    """The new process published past the old last number before any of its batches
    arrived: the gap's replay asks from the last applied number (the anchor), which comes
    back with other bytes. (Had its first batch to arrive been numbered exactly last + 1,
    nothing would tell it apart from the old process's next one: README, precise mode.)"""
    pub = pubs(replay="new")
    eng = engine()
    idx, sub = follow(pub)
    with sub:
        warm_up(pub, sub, 0)
        last = send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        pub.restart()
        eng = engine()
        for i in range(last + 2):
            pub.publish(batch(eng.serve(prompt(10 + i, 32))), send=False)
        seq = pub.publish(batch(eng.serve(prompt(9))))
        settle(sub, 0, seq, restarts=base["restarts"] + 1)
        assert idx.held(0).tolist() == eng.truth()
        assert pub.requests[-2:] == [last, 0]
        assert delta(sub, 0, base)["resyncs"] == 0


@pytest.mark.parametrize("bind", [False, True])
def test_restart_whose_first_arriving_number_is_the_next_one(pubs, bind):
    """The new process's first batch to arrive carries exactly the number expected next.
    Numbers cannot tell; the new connection can: it is probed from the last applied
    number, whose bytes differ. Both ways round: the engine binds, or connects to us."""
    idx, applier = new_applier()
    pub = pubs(replay="new")
    src = Source(0, "tcp://127.0.0.1:*" if bind else pub.endpoint, pub.replay_endpoint, bind=bind)
    # The probe also recovers the new process's first live batch when the new connection's
    # subscription is not through yet (ZMQ's slow joiner).
    with Subscriber(applier, [src], probe_interval=0.05) as sub:
        if bind:
            pub.attach(sub.endpoints[0])
        eng = engine()
        warm_up(pub, sub, 0)
        last = send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        pub.restart(rebind=True)
        eng = engine()
        for i in range(last + 1):
            pub.publish(batch(eng.serve(prompt(10 + i, 32))), send=False)
        assert wait_until(lambda: status(sub)["reconnects"] > base["reconnects"])
        seq = pub.publish(batch(eng.serve(prompt(9))))
        assert seq == last + 1
        settle(sub, 0, seq, restarts=base["restarts"] + 1)
        assert idx.held(0).tolist() == eng.truth()


def test_restart_with_every_batch_lost_is_found_by_the_probe(pubs):
    """Nothing of the new process arrives and it goes quiet: the tail probe asks from the
    last applied number, the ring has nothing that far, so the numbers went back."""
    pub = pubs(replay="new")
    eng = engine()
    idx, sub = follow(pub, probe_interval=0.05)
    with sub:
        warm_up(pub, sub, 0)
        for i in range(3):
            send(pub, sub, 0, eng.serve(prompt(i)))
        base = status(sub)
        pub.restart()
        eng = engine()
        seq = pub.publish(batch(eng.serve(prompt(5))), send=False)
        settle(sub, 0, seq, restarts=base["restarts"] + 1)
        assert idx.held(0).tolist() == eng.truth()


# -- replays ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["new", "old"])
def test_replay_with_a_hole_is_applied_as_it_streams_and_asked_again(pubs, layout):
    """Issue 9 case 3: the contiguous part is applied before the next round is answered;
    the next round starts at the last applied number (anchor), so the first missing one."""
    pub = pubs(replay=layout)
    eng = engine()
    idx, sub = follow(pub)
    with sub:
        warm_up(pub, sub, 0)
        last = send(pub, sub, 0, eng.serve(prompt(0)))
        truth = {}
        for i in range(1, 5):
            seq = pub.publish(batch(eng.serve(prompt(i))), send=False)
            truth[seq] = eng.truth()
        base = status(sub)
        gate = threading.Event()
        pub.drops = [{last + 3}]
        pub.holds = [None, gate]
        final = pub.publish(batch(eng.serve(prompt(5))))
        # Round 1 gave last+1, last+2, then a hole: applied already, round 2 not answered.
        assert wait_until(lambda: len(pub.requests) >= 2 and status(sub)["last_seq"] == last + 2)
        assert idx.held(0).tolist() == truth[last + 2]
        gate.set()
        settle(sub, 0, final)
        assert idx.held(0).tolist() == eng.truth()
        assert pub.requests[-2:] == [last, last + 2]
        d = delta(sub, 0, base, ("gaps", "replays", "partial_replays", "resyncs"))
        assert d == {"gaps": 1, "replays": 2, "partial_replays": 1, "resyncs": 0}


def test_large_replay_losing_replies_to_the_high_water_mark_converges(pubs):
    """A replay of hundreds of batches through a ROUTER that loses every other reply after
    its first `window` (kv-events.md D): each round applies what is contiguous, the next
    starts where it stopped, and the replica ends exact without a resync."""
    pub = pubs(replay="new", window=40)
    eng = engine(capacity=256)
    idx, sub = follow(pub)
    with sub:
        warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        for i in range(1, 300):
            pub.publish(batch(eng.serve(prompt(i % 40, 16 * (1 + i % 5)))), send=False)
        final = pub.publish(batch(eng.serve(prompt(41))))
        settle(sub, 0, final)
        assert idx.held(0).tolist() == eng.truth()
        d = delta(sub, 0, base, ("replays", "partial_replays", "resyncs"))
        assert d["resyncs"] == 0 and d["partial_replays"] >= 5 and d["replays"] == d["partial_replays"] + 1
        assert pub.requests == sorted(pub.requests)


def test_gap_older_than_the_ring_resyncs_then_follows(pubs):
    """The ring no longer holds the first missing number: clear, then apply from the
    ring's first batch on, and claim nothing the engine lacks."""
    pub = pubs(replay="old", buffer_steps=3)
    eng = engine(capacity=12)
    idx, sub = follow(pub)
    with sub:
        warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        for i in range(1, 8):
            pub.publish(batch(eng.serve(prompt(i % 3, 32 + 16 * i))), send=False)
        final = pub.publish(batch(eng.serve(prompt(2))))
        settle(sub, 0, final)
        assert set(idx.held(0).tolist()) <= set(eng.truth())
        d = delta(sub, 0, base, ("gaps", "replays", "resyncs"))
        assert d == {"gaps": 1, "replays": 1, "resyncs": 1}
        assert status(sub)["replayed_batches"] - base["replayed_batches"] == 2


# -- tail loss ------------------------------------------------------------------------------


def test_tail_loss_is_recovered_by_the_probe(pubs):
    """Issue 9 case 4: the last batches of a burst are lost and the engine goes quiet."""
    pub = pubs(replay="new")
    eng = engine()
    idx, sub = follow(pub, probe_interval=0.05)
    with sub:
        warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        pub.publish(batch(eng.serve(prompt(1))), send=False)
        last = pub.publish(batch(eng.serve(prompt(2))), send=False)
        settle(sub, 0, last)
        assert idx.held(0).tolist() == eng.truth()
        d = delta(sub, 0, base, ("probe_recoveries", "gaps", "resyncs"))
        assert d == {"probe_recoveries": 1, "gaps": 0, "resyncs": 0}


# -- bounds -------------------------------------------------------------------------------


def test_a_replay_that_never_ends_stalls_no_one(pubs):
    """Issue 11 item 4: replies stream forever, the one missing batch never among them, and
    no end marker. Another publisher's batches keep being applied meanwhile; what is held
    stays under the cap; the round times out, is asked again, then the replica resyncs."""
    cap = 48 * 1024
    pub0, pub1 = pubs(replay="new", endless=True), pubs(replay="new")
    eng0, eng1 = engine(capacity=4096), engine(capacity=4096)
    idx, applier = new_applier()
    srcs = [Source(0, pub0.endpoint, pub0.replay_endpoint), Source(1, pub1.endpoint, pub1.replay_endpoint)]
    sub = Subscriber(applier, srcs, replay_timeout=0.3, replay_max_seconds=0.6, replay_attempts=2,
                     max_buffer_bytes=cap, probe_interval=None)
    with sub:
        warm_up(pub0, sub, 0)
        warm_up(pub1, sub, 1)
        last = send(pub0, sub, 0, eng0.serve(prompt(0)))
        pub0.publish(batch(eng0.serve(prompt(1, 1024))), send=False)
        pub0.drops = [{last + 1}] * 4
        for i in range(2, 30):
            pub0.publish(batch(eng0.serve(prompt(i, 1024))))
        assert wait_until(lambda: status(sub, 0)["replaying"])
        for i in range(20):  # replica 1 is followed while replica 0's replay streams
            send(pub1, sub, 1, eng1.serve(prompt(i, 48)))
            assert status(sub, 0)["buffered_bytes"] <= cap
        assert idx.held(1).tolist() == eng1.truth()
        assert wait_until(lambda: status(sub, 0)["resyncs"] >= 1)
        st = status(sub, 0)
        assert st["replay_timeouts"] >= 2 and st["peak_buffered_bytes"] <= cap and st["buffer_drops"] > 0
        assert set(idx.held(0).tolist()) <= set(eng0.truth())


def test_held_batches_are_capped_and_the_replay_still_completes(pubs):
    """Replies beyond a hole are held up to max_buffer_bytes (highest numbers dropped
    first); the next round brings the rest and the replica ends exact."""
    cap = 32 * 1024
    pub = pubs(replay="new")
    eng = engine(capacity=8192)
    idx, sub = follow(pub, max_buffer_bytes=cap)
    with sub:
        warm_up(pub, sub, 0)
        last = send(pub, sub, 0, eng.serve(prompt(0)))
        base = status(sub)
        for i in range(1, 40):
            pub.publish(batch(eng.serve(prompt(i, 1024))), send=False)  # ~3.6 KB each
        pub.drops = [{last + 2}]
        final = pub.publish(batch(eng.serve(prompt(40))))
        settle(sub, 0, final)
        assert idx.held(0).tolist() == eng.truth()
        st = status(sub)
        assert st["peak_buffered_bytes"] <= cap and st["buffer_drops"] > base["buffer_drops"]
        assert st["resyncs"] == base["resyncs"] and st["buffered_bytes"] == 0


def test_settings_are_checked():
    _, applier = new_applier()
    src = [Source(0, "tcp://127.0.0.1:1")]
    for kw in ({"replay_timeout": 0}, {"replay_max_seconds": -1.0}, {"probe_interval": 0},
               {"poll_interval": float("inf")}, {"replay_timeout": True}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name} must be a positive number of seconds"):
            Subscriber(applier, src, **kw)
    for kw in ({"replay_attempts": 0}, {"max_buffer_bytes": 1.5}, {"replay_attempts": True}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            Subscriber(applier, src, **kw)
    Subscriber(applier, src, probe_interval=None)
