"""`kvroute serve --state-dir`: a snapshot taken while events stream in holds exactly the
batches its cursors name (gateway/snapshots.py holds the subscribers during the copy).

A publisher streams batches, each storing one new block, while the gateway writes snapshots
one after another. Each file, restored into a fresh router and applier, must hold exactly the
blocks of the batches up to its saved cursor: a block after it would be replayed again after a
restore (a removal in between would be lost), a missing one was never saved.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("aiohttp")

from kv_wire import batch, stored  # noqa: E402
from zmq_pub import WAIT, ctx, pubs  # noqa: E402, F401

from kvroute import Router, block_hashes  # noqa: E402
from kvroute.config import RouterConfig  # noqa: E402
from kvroute.events import EventApplier  # noqa: E402
from kvroute.gateway.app import Gateway  # noqa: E402
from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from tests.gateway_harness import free_port, wait_until  # noqa: E402

SNAPSHOTS = 40


def _tokens(i: int) -> list[int]:
    return list(range(16 * i, 16 * i + 16))


def test_snapshots_under_streaming_events_hold_exactly_their_cursors(pubs, tmp_path):
    pub = pubs(replay="new", buffer_steps=100_000)  # a gap, if any, is replayed: never a resync
    spec = ReplicaSpec("http://127.0.0.1:9", name="e0", events=pub.endpoint, replay=pub.replay_endpoint)
    gw = Gateway(GatewayConfig(replicas=(spec,), port=free_port(), state_dir=str(tmp_path), tokenizer="engine"))
    block_of: dict[int, int] = {}  # publisher seq -> the kvroute hash its batch stores
    stop = threading.Event()

    def publish(i: int) -> int:
        seq = pub.publish(batch([stored("vllm-array", [10_000 + i], None, _tokens(i), 16)]))
        block_of[seq] = int(block_hashes(np.array(_tokens(i)), 16)[0])
        return seq

    def stream() -> None:
        i = 0
        while not stop.is_set():
            publish(i)
            i += 1
            time.sleep(0.0002)  # well within what the subscriber keeps up with: no gaps, no resync

    try:
        rep = gw.fleet.get("e0")

        def joined() -> bool:  # ZMQ's slow joiner drops the first batches: empty ones until one lands
            if rep.subscriber.cursors():
                return True
            pub.publish(batch([]))
            return False

        assert wait_until(joined, WAIT, 0.05)
        t = threading.Thread(target=stream)
        t.start()
        files = []
        try:
            for k in range(SNAPSHOTS):
                gw.snapshots._write()
                path = tmp_path / f"copy{k}"
                path.write_bytes((tmp_path / "router.kvrsnap").read_bytes())
                files.append(path)
        finally:
            stop.set()
            t.join()
        last_seqs = []
        for path in files:
            router = Router(RouterConfig(mode="precise", block_size=16), [])
            applier = EventApplier(router.index, 16)
            info = router.restore(str(path), applier=applier)
            seq = info["cursors"]["e0"]["seq"]
            held = set(router.index.held(router.replica_id("e0")).tolist())
            assert held == {h for s, h in block_of.items() if s <= seq}, (path, seq)
            last_seqs.append(seq)
        assert rep.subscriber.status()["resyncs"] == 0
        assert last_seqs == sorted(last_seqs) and last_seqs[-1] > last_seqs[0]  # events flowed meanwhile
    finally:
        gw.fleet.stop_following()
