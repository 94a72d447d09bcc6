"""The ZMQ subscriber against real publishers on loopback (ephemeral ports) that speak each
engine's protocol byte for byte (kv-events.md A1, A3): 3-frame PUB messages, sequence
numbers, and a ROUTER replay endpoint with vLLM's current reply layout ([topic, seq,
payload]), its older one, or SGLang's ([seq, payload]). After each scenario the index must
hold what the simulated engine caches. Every wait is bounded."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")

from kv_wire import Engine, batch, stored  # noqa: E402
from zmq_pub import WAIT, ctx, delta, new_applier, pubs, send, warm_up  # noqa: E402, F401

from kvroute.events import Source, Subscriber  # noqa: E402

BASE = list(range(5000, 5000 + 128))


ZERO = dict(gaps=0, replays=0, resyncs=0, restarts=0, malformed=0, bad_frames=0, duplicates=0)

# SGLang 0.5.18 replies [seq, payload]; 0.5.23 like vLLM 0.33 [topic, seq, payload] (kv-events.md D).
SPEAKERS = [("vllm-array", "old"), ("vllm-map", "new"), ("sglang", "old"), ("sglang", "new")]


@pytest.mark.parametrize("impl_name", ["native", "reference"])
@pytest.mark.parametrize("fmt, layout", SPEAKERS)
def test_stream_stores_removes_clears_and_duplicates(pubs, fmt, layout, impl_name):
    pub = pubs(replay=layout)
    idx, applier = new_applier(impl_name)
    eng = Engine(fmt, capacity=6, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(1, pub.endpoint, pub.replay_endpoint)]) as sub:
        base = warm_up(pub, sub, 1)
        send(pub, sub, 1, eng.serve(BASE[:64]))
        send(pub, sub, 1, eng.step([BASE[:96] + [1] * 16, BASE[:96] + [2] * 16]))  # duplicate stores
        assert idx.held(1).tolist() == eng.truth()
        send(pub, sub, 1, eng.serve(BASE[32:128]))  # evicts
        assert idx.held(1).tolist() == eng.truth() and idx.blocks(0) == 0
        send(pub, sub, 1, eng.clear() + eng.serve(BASE[:32]))
        assert idx.held(1).tolist() == eng.truth() != []
        assert delta(sub, 1, base) == ZERO
        st = sub.status()
        assert st["replicas"][1]["lag"] is not None and st["applier"]["clears"] == 1


def test_unknown_parent_event_is_counted_and_skipped(pubs):
    pub = pubs(replay="new")
    idx, applier = new_applier()
    eng = Engine("vllm-map", capacity=8, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(0, pub.endpoint, pub.replay_endpoint)]) as sub:
        base = warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(BASE[:32]))
        send(pub, sub, 0, [stored("vllm-map", [42], 777, BASE[:16], 16)])  # a parent never announced
        assert delta(sub, 0, base)["malformed"] == 0
        assert sub.status()["applier"]["unknown_parents"] == 1
        assert sub.status()["replicas"][0]["skipped"]["unknown_parent"] == 1
        assert idx.held(0).tolist() == eng.truth()


@pytest.mark.parametrize("fmt, layout", SPEAKERS)
def test_gap_recovered_by_replay(pubs, fmt, layout):
    pub = pubs(replay=layout)
    idx, applier = new_applier()
    eng = Engine(fmt, capacity=10, engine_block_size=32, block_size=16)
    with Subscriber(applier, [Source(0, pub.endpoint, pub.replay_endpoint)]) as sub:
        base = warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(BASE[:64]))
        send(pub, sub, 0, eng.serve(BASE[:96]), send=False)  # lost on the wire
        send(pub, sub, 0, eng.serve(BASE[:128]), send=False)
        send(pub, sub, 0, eng.serve(BASE[64:128]))
        assert idx.held(0).tolist() == eng.truth()
        d = delta(sub, 0, base)
        assert d["gaps"] == 1 and d["replays"] == 1 and d["resyncs"] == 0
        assert sub.status()["replicas"][0]["replayed_batches"] >= 2


@pytest.mark.parametrize("replay", ["new", None])
def test_unrecoverable_gap_resyncs(pubs, replay):
    pub = pubs(replay=replay, buffer_steps=2)
    idx, applier = new_applier()
    eng = Engine("sglang", capacity=10, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(0, pub.endpoint, pub.replay_endpoint)], replay_timeout=2.0) as sub:
        base = warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(BASE[:64]))
        for n in (80, 96, 112):
            send(pub, sub, 0, eng.serve(BASE[:n]), send=False)  # the ring keeps only 2
        send(pub, sub, 0, eng.serve(BASE[200 - 128 : 200 - 96] + [3] * 16))
        d = delta(sub, 0, base)
        # One replay asked (when there is an endpoint); its ring no longer held the gap.
        assert d["gaps"] == 1 and d["resyncs"] == 1 and d["replays"] == (replay is not None)
        # Resynced: the replica was cleared, so it claims nothing the engine lacks.
        assert set(idx.held(0).tolist()) <= set(eng.truth())
        # The operator's remedy for a lost history, reset_prefix_cache, realigns it exactly.
        send(pub, sub, 0, eng.clear() + eng.serve(BASE[:48]))
        assert idx.held(0).tolist() == eng.truth()


def test_publisher_restart_resets_the_replica(pubs):
    pub = pubs(replay="old")
    idx, applier = new_applier()
    eng = Engine("vllm-array", capacity=10, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(1, pub.endpoint, pub.replay_endpoint)]) as sub:
        base = warm_up(pub, sub, 1)
        send(pub, sub, 1, eng.serve(BASE[:64]))
        assert idx.blocks(1) == 4
        # The engine process restarts: empty cache, sequence numbers from 0 again.
        pub.restart()
        eng = Engine("vllm-array", capacity=10, engine_block_size=16, block_size=16)
        seq = pub.publish(batch(eng.serve(BASE[64:96])))
        assert seq == 0
        deadline = time.monotonic() + WAIT
        while sub.status()["replicas"][1]["restarts"] == base["restarts"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert delta(sub, 1, base)["restarts"] == 1
        send(pub, sub, 1, eng.serve(BASE[64:128]))
        assert idx.held(1).tolist() == eng.truth()


def test_malformed_payloads_and_frames(pubs):
    pub = pubs(replay="new")
    idx, applier = new_applier()
    eng = Engine("vllm-map", capacity=10, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(0, pub.endpoint, pub.replay_endpoint)]) as sub:
        base = warm_up(pub, sub, 0)
        send(pub, sub, 0, eng.serve(BASE[:64]))
        good = batch(eng.serve(BASE[:96]))
        pub.publish(good[: len(good) // 2])  # truncated
        pub.publish(b"\xc1garbage")
        pub.pub.send_multipart([b"", b"short"])  # not a 3-frame message
        seq = pub.publish(good)
        assert sub.wait_for_seq(0, seq, timeout=WAIT)
        d = delta(sub, 0, base)
        assert d["malformed"] == 2 and d["bad_frames"] == 1 and d["gaps"] == 0
        assert idx.held(0).tolist() == eng.truth()


def test_topic_filter_and_bind_mode(ctx, pubs):
    idx, applier = new_applier()
    # Replica 0: the engine binds, topic kv@pod0@m. Replica 1: the subscriber binds and the
    # engine connects to it.
    pub0 = pubs(topic="kv@pod0@m", replay="new")
    src1 = Source(1, "tcp://127.0.0.1:*", topic="kv@", bind=True)
    eng0 = Engine("vllm-map", capacity=8, engine_block_size=16, block_size=16)
    eng1 = Engine("vllm-array", capacity=8, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(0, pub0.endpoint, pub0.replay_endpoint, topic="kv@pod0"), src1]) as sub:
        pub1 = pubs(topic="kv@pod1@m", replay=None, connect=sub.endpoints[1])
        other = pubs(topic="metrics", replay=None, connect=sub.endpoints[1])
        warm_up(pub0, sub, 0)
        warm_up(pub1, sub, 1)
        other.publish(batch(Engine("sglang", 8, 16, 16).serve(BASE[:64])))  # filtered out
        send(pub0, sub, 0, eng0.serve(BASE[:48]))
        send(pub1, sub, 1, eng1.serve(BASE[48:112]))
        assert idx.held(0).tolist() == eng0.truth() and idx.held(1).tolist() == eng1.truth()
        assert sub.status()["replicas"][1]["bad_frames"] == 0


def test_lifecycle_and_errors(pubs):
    pub = pubs(replay=None)
    _, applier = new_applier()
    sub = Subscriber(applier, [Source(0, pub.endpoint)])
    assert not sub.running
    sub.start()
    assert sub.running
    with pytest.raises(RuntimeError, match="already started"):
        sub.start()
    sub.stop()
    sub.stop()
    assert not sub.running
    with pytest.raises(ValueError, match="replica 0 has more than one source"):
        Subscriber(applier, [Source(0, "tcp://127.0.0.1:1"), Source(0, "tcp://127.0.0.1:2")])
    with pytest.raises(TypeError, match="sources must be Source objects"):
        Subscriber(applier, ["tcp://127.0.0.1:1"])
    bad = Subscriber(applier, [Source(0, "nonsense://x", bind=True)])
    with pytest.raises(RuntimeError, match="could not start"):
        bad.start()
    assert not bad.running


def test_apply_errors_do_not_stop_the_thread(pubs):
    pub0, pub1 = pubs(replay=None), pubs(replay=None)
    idx, applier = new_applier()
    eng = Engine("vllm-array", capacity=8, engine_block_size=16, block_size=16)
    with Subscriber(applier, [Source(0, pub0.endpoint), Source(1, pub1.endpoint)]) as sub:
        warm_up(pub0, sub, 0)
        warm_up(pub1, sub, 1)
        idx.remove_replica(0)  # the router dropped replica 0 while its engine still publishes
        pub0.publish(batch(eng.serve(BASE[:32])))
        deadline = time.monotonic() + WAIT
        while sub.status()["replicas"][0]["errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = sub.status()["replicas"][0]
        assert st["errors"] == 1 and st["last_exception"] == "IndexError: replica 0 was removed"
        eng1 = Engine("vllm-array", capacity=8, engine_block_size=16, block_size=16)
        send(pub1, sub, 1, eng1.serve(BASE[:48]))
        assert sub.running and idx.held(1).tolist() == eng1.truth()
