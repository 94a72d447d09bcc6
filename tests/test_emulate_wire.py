"""The emulator's KV-event wire form and replay socket, byte for byte against
../shared/docs/kv-events.md (A1, A2, D): tagged-map events (vLLM >= 0.25) and positional
arrays (12-element BlockStored, v0.23) in an array batch [ts, events, rank], decoded by
kvroute's own EventApplier into the blocks the events describe; the replay ROUTER answers
REQ and DEALER requests with [topic, seq, payload] and ends with [b"", END_SEQ, b""]."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

import zmq.asyncio  # noqa: E402

from kvroute.emulate.publisher import END_SEQ, EventPublisher  # noqa: E402
from kvroute.emulate.wire import encode_batch  # noqa: E402

WAIT = 20.0  # seconds; generous bound on a loaded machine, never reached when things work


@dataclass
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass
class AllBlocksCleared:
    pass


TOKENS = tuple(range(100, 148))
EVENTS = [BlockStored((11, 12, (1 << 64) - 1), None, TOKENS, 16), BlockRemoved((12,)), AllBlocksCleared()]


def test_maps_match_vllm_tagged_map_layout():
    ts, events, rank = msgspec.msgpack.decode(encode_batch(EVENTS, "maps", ts=1.5))
    assert (ts, rank) == (1.5, 0)
    stored, removed, cleared = events
    assert stored == {"type": "BlockStored", "block_hashes": [11, 12, (1 << 64) - 1], "parent_block_hash": None,
                      "token_ids": list(TOKENS), "block_size": 16, "lora_id": None, "medium": "GPU",
                      "lora_name": None, "extra_keys": [None, None, None], "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}
    assert removed == {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_arrays_match_vllm_positional_layout():
    _, events, _ = msgspec.msgpack.decode(encode_batch(EVENTS, "arrays", ts=1.5))
    stored, removed, cleared = events
    assert len(stored) == 12 and stored[:7] == ["BlockStored", [11, 12, (1 << 64) - 1], None, list(TOKENS), 16,
                                               None, "GPU"]
    assert removed == ["BlockRemoved", [12], "GPU", 0]
    assert cleared == ["AllBlocksCleared"]


def test_lora_name_goes_to_the_field_and_extra_keys():
    ev = BlockStored((5,), 4, tuple(range(16)), 16, lora_name="adapter")
    _, (m,), _ = msgspec.msgpack.decode(encode_batch([ev], "maps"))
    assert m["lora_name"] == "adapter" and m["extra_keys"] == [["adapter"]] and m["parent_block_hash"] == 4


def test_unknown_encoding_and_event_are_refused():
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(EVENTS, "json")
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch([object()], "maps")


@pytest.mark.parametrize("encoding", ["maps", "arrays"])
def test_kvroute_applier_reads_both_encodings(impl, encoding):
    index = impl.PrefixIndex(1)
    applier = impl.EventApplier(index, 16)
    parent = BlockStored((1, 2), None, tuple(range(32)), 16)
    child = BlockStored((3,), 2, tuple(range(32, 48)), 16)
    assert applier.apply(0, encode_batch([parent, child], encoding))
    want = impl.block_hashes(np.arange(48), 16)
    assert sorted(int(h) for h in index.held(0)) == sorted(int(h) for h in want)
    assert applier.apply(0, encode_batch([BlockRemoved((3,))], encoding))
    assert sorted(int(h) for h in index.held(0)) == sorted(int(h) for h in want[:2])
    assert applier.apply(0, encode_batch([AllBlocksCleared()], encoding))
    assert len(index.held(0)) == 0


def _ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.parametrize("client", ["req", "dealer", "dealer-bare"])
def test_pub_frames_and_replay(client):
    pub_port, replay_port = _ports(2)
    head = [b""] if client == "dealer" else []

    async def ask(sock, start):
        """Replies to one replay request, delimiter stripped (REQ takes only the first)."""
        if client == "req":
            await sock.send(start.to_bytes(8, "big"))
            return [await asyncio.wait_for(sock.recv_multipart(), WAIT)]
        await sock.send_multipart([*head, start.to_bytes(8, "big")])
        replies = []
        while not replies or replies[-1][-1] != b"":
            replies.append((await asyncio.wait_for(sock.recv_multipart(), WAIT))[len(head):])
        return replies

    async def scenario():
        ctx = zmq.asyncio.Context()
        pub = EventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv",
                             buffer_steps=3, ctx=ctx)
        pub.start()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        # PUB drops until the subscription arrives: publish probes until one gets through.
        first = None
        while first is None:
            pub.publish([AllBlocksCleared()])
            try:
                first = await asyncio.wait_for(sub.recv_multipart(), 0.2)
            except asyncio.TimeoutError:
                pass
        assert pub.publish([]) == -1  # nothing to send, no sequence number used
        for _ in range(4):
            pub.publish([BlockRemoved((7,))])
        sock = ctx.socket(zmq.REQ if client == "req" else zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{replay_port}")
        recent = await ask(sock, pub.seq - 2)
        old = [] if client == "req" else await ask(sock, 0)
        for s in (sub, sock):
            s.close(0)
        pub.close()
        ctx.term()
        return first, recent, old, pub.seq - 1

    first, recent, old, last = asyncio.run(scenario())
    topic, seq, payload = first
    assert topic == b"kv" and len(seq) == 8
    assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    assert recent[0][0] == b"kv" and int.from_bytes(recent[0][1], "big") == last - 1
    assert msgspec.msgpack.decode(recent[0][2])[1] == [{"type": "BlockRemoved", "block_hashes": [7],
                                                        "medium": "GPU", "group_idx": 0}]
    if client != "req":
        assert [int.from_bytes(f[1], "big") for f in recent[:-1]] == [last - 1, last]
        assert recent[-1] == [b"", END_SEQ, b""]
        # A buffer of 3 batches: asking from 0 returns what is left, in order, then the end.
        assert [int.from_bytes(f[1], "big") for f in old[:-1]] == [last - 2, last - 1, last]
        assert old[-1] == [b"", END_SEQ, b""]
