"""A loopback KV event publisher that speaks vLLM's and SGLang's ZMQ protocol byte for byte
(kv-events.md A1, A3, D), for the subscriber tests.

PUB: 3-frame messages [topic, seq (8-byte big-endian), payload], numbers from 0 per process.
Replay ROUTER: a request [identity, b"", start] is answered with every batch of the ring
(the last `buffer_steps`) numbered `start` or later, then the end marker; layout "new"
(vLLM >= #45177, SGLang 0.5.23: [topic, seq, payload], end [b"", END_SEQ, b""]) or "old"
([seq, payload], end [END_SEQ, b""]).

Losses are scripted so that tests are deterministic:
- `publish(..., send=False)`: the batch enters the ring but never reaches the wire.
- `drops`: a list of sets, one per coming request, of numbers whose replies are lost.
- `window`: mimics the replay socket's send high-water mark (kv-events.md D): after the
  first `window` replies of a request, every other reply is lost.
- `holds`: a list, one per coming request, of Events (or None) the ROUTER waits on before
  answering it (to look at the subscriber between two rounds).
- `endless`: replies stream forever (the ring again and again, `drops` permanent) and the
  end marker never comes.
- `restart()`: a new process: numbers from 0 again, empty ring.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import zmq
from conftest import load_impl
from kv_wire import batch

from kvroute.events import END_SEQ

WAIT = 20.0  # seconds; generous for a loaded 2-core machine, never reached when things work


class Publisher:
    """A KV event publisher: PUB (bound, or connected to a subscriber that binds) plus an
    optional ROUTER replay endpoint answering from a ring of the last `buffer_steps` batches."""

    def __init__(self, ctx, *, topic="", replay="new", buffer_steps=1000, connect=None,
                 window=None, endless=False):
        self.ctx = ctx
        self.connect = connect
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect:
            self.pub.connect(connect)
            self.endpoint = connect
        else:
            self.pub.bind("tcp://127.0.0.1:*")
            self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.layout = replay
        self.window = window
        self.endless = endless
        self.drops: list[set[int]] = []
        self.holds: list[threading.Event | None] = []
        self.replay_endpoint = None
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def publish(self, payload: bytes, *, send=True, frames=None) -> int:
        """Number, ring and (unless send=False) send one batch; returns its number."""
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.ring.append((seq, payload))
        if send:
            self.pub.send_multipart(frames or [self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def attach(self, endpoint):
        """Connect the PUB to a subscriber that binds `endpoint` (instead of binding)."""
        self.pub.close(0)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(endpoint)
        self.connect = self.endpoint = endpoint

    def restart(self, *, rebind=False):
        """The engine process restarts: numbers from 0, nothing to replay. With rebind=True
        its sockets are closed and bound again on the same ports, as a new process does (the
        subscriber then sees a new connection, and loses what is sent before it is made)."""
        with self.lock:
            self.seq = 0
            self.ring.clear()
        if not rebind:
            return
        if self._thread:
            self._stop.set()
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)
        if self.connect:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.connect(self.connect)
        else:
            self.pub = _bound(self.ctx, zmq.PUB, self.endpoint)
        if self._thread:
            self.router = _bound(self.ctx, zmq.ROUTER, self.replay_endpoint)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, empty, start = self.router.recv_multipart()
            assert empty == b"" and len(start) == 8
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            hold = self.holds.pop(0) if self.holds else None
            while hold is not None and not hold.wait(0.02):
                if self._stop.is_set():
                    return
            with self.lock:
                items = [(s, p) for s, p in self.ring if s >= first]
                lost = self.drops.pop(0) if self.drops else set()
            if self.endless:
                self._forever(ident, items, lost)
                continue
            for i, (s, p) in enumerate(items):
                if s in lost or (self.window is not None and i >= self.window and i % 2):
                    continue
                self._send(ident, s, p)
            self._send(ident, None, b"")

    def _forever(self, ident, items, lost):
        """Stream the items again and again until another request comes or close()."""
        while not self._stop.is_set() and not self.router.poll(1):
            for s, p in items:
                if s not in lost:
                    self._send(ident, s, p)

    def _send(self, ident, seq, payload):
        seq_b = END_SEQ if seq is None else seq.to_bytes(8, "big")
        if self.layout == "new":
            topic = b"" if seq is None else self.topic
            self.router.send_multipart([ident, b"", topic, seq_b, payload])
        else:
            self.router.send_multipart([ident, b"", seq_b, payload])

    def close(self):
        """Stop the ROUTER thread and close the sockets."""
        self._stop.set()
        if self._thread:
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)


def _bound(ctx, kind, endpoint):
    """A socket bound to `endpoint`, retried while the closed one still holds the port."""
    deadline = time.monotonic() + WAIT
    while True:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.bind(endpoint)
            return s
        except zmq.ZMQError:
            s.close(0)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


@pytest.fixture
def ctx():
    """A ZMQ context for the test's publishers."""
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def pubs(ctx):
    """A factory of Publishers, all closed at the end of the test."""
    made = []

    def make(**kw):
        p = Publisher(ctx, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def new_applier(name="native", replicas=2):
    """A PrefixIndex of `replicas` and an EventApplier on it (router block size 16)."""
    M = load_impl(name)
    idx = M.PrefixIndex(replicas)
    return idx, M.EventApplier(idx, 16)


def warm_up(pub, sub, replica):
    """Publish empty batches until the subscriber sees one (ZMQ's slow joiner drops the first);
    returns the subscriber's counters at that point, for deltas."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        seq = pub.publish(batch([]))
        if sub.wait_for_seq(replica, seq, timeout=0.05):
            return sub.status()["replicas"][replica]
    raise AssertionError("subscriber never received a batch")


def send(pub, sub, replica, events, **kw):
    """Publish one batch of events; unless it is lost (send=False), wait until it is applied."""
    seq = pub.publish(batch(events), **kw)
    if kw.get("send", True):
        assert sub.wait_for_seq(replica, seq, timeout=WAIT)
    return seq


COUNTERS = ("gaps", "replays", "partial_replays", "replay_timeouts", "probes", "probe_recoveries",
            "resyncs", "restarts", "malformed", "bad_frames", "duplicates", "buffer_drops")


def delta(sub, replica, base, keys=COUNTERS[:2] + COUNTERS[6:11]):
    """Counter changes of one replica since `base` (a status()["replicas"][r] dict)."""
    now = sub.status()["replicas"][replica]
    return {k: now[k] - base[k] for k in keys}


def wait_until(pred, timeout=WAIT, step=0.005):
    """Poll `pred` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True
