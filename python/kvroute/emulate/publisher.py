"""A KV-event publisher that behaves like vLLM's ZmqEventPublisher.

vllm/distributed/kv_events.py: a PUB socket sends each batch as three frames (topic,
sequence number as 8 bytes big-endian starting at 0, msgpack batch); the last
`buffer_steps` batches are kept for a replay ROUTER, which answers a request
`[identity, b"", start_seq]` (a REQ client, or a DEALER sending `[b"", seq]`) with one
message per buffered batch with seq >= start_seq and then an end marker. A DEALER that
sends the bare `[seq]` frame is answered without the empty delimiter. Replies use the
layout of vLLM >= PR #45177: `[topic, seq, payload]`, end `[b"", END_SEQ, b""]`
(../shared/docs/kv-events.md A1, D). Like vLLM 0.33 the ROUTER's send high-water mark is
raised to the buffer size, so a replay of the whole buffer is not cut short.

Memory: the replay buffer holds at most `buffer_steps` batches (vLLM's default, 10,000).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Sequence

import zmq
import zmq.asyncio

from .wire import encode_batch

END_SEQ = b"\xff" * 8
log = logging.getLogger("kvroute.emulate")


class EventPublisher:
    """PUB + replay ROUTER for one engine; publish() from the event loop's thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 encoding: str = "maps", buffer_steps: int = 10_000, hwm: int = 100_000,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.encoding = encoding
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._router: Any = None
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, max(1000, 2 * buffer_steps + 2))
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, events: Sequence[Any], ts: float | None = None) -> int:
        """Encode and send one batch; returns its sequence number (-1: nothing to send)."""
        if not events:
            return -1
        payload = encode_batch(events, self.encoding, ts=ts)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            # PUB never blocks: at the high-water mark ZMQ drops, as it does for vLLM.
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - PUB drops instead of raising
            pass
        return seq

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            try:
                self._answer(frames)
            except zmq.ZMQError as exc:  # pragma: no cover - peer vanished mid-reply
                log.warning("replay reply failed: %s", exc)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) not in (2, 3) or len(frames[-1]) != 8 or (len(frames) == 3 and frames[1]):
            log.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        head = frames[:-1]  # identity, plus the empty delimiter when the client sent one
        start = int.from_bytes(frames[-1], "big")
        send = self._router.send_multipart
        for seq, payload in list(self.buffer):
            if seq >= start:
                send([*head, self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        send([*head, b"", END_SEQ, b""], flags=zmq.NOBLOCK)

    def close(self) -> None:
        """Stop replaying and close both sockets."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)


__all__ = ["END_SEQ", "EventPublisher"]
