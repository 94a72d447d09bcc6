"""Precise mode: follow what each engine caches through the KV events vLLM and SGLang publish.

Three parts (wire formats: docs kv-events.md):

- `decode(payload)`: one msgpack batch -> EventBatch (ts, events, dp_rank) of BlockStored,
  BlockRemoved and AllBlocksCleared, with engine hashes normalized to uint64; raises
  MalformedBatch (a ValueError). Pure Python (msgspec); needs no ZMQ.
- `EventApplier(index, block_size=16, *, salt=None, tier_index=None)`: applies one
  engine's batches to its replica id of a PrefixIndex, recomputing kvroute's chained hashes
  from each BlockStored's token_ids. The native one (kvroute._native) takes the native
  PrefixIndex; the reference one the reference PrefixIndex; `kvroute.events.EventApplier`
  is the backend's (KVROUTE_IMPLEMENTATION). Semantics: kvroute.reference.events.
- `Subscriber(applier, sources)`: a background thread with one ZMQ SUB socket per engine
  publisher (connect, or bind where the engine connects), sequence tracking per publisher,
  replay over DEALER on a gap, resync (clear the replica) when replay is absent or cannot
  cover the gap, and reset on a publisher restart (sequence back to 0). pyzmq is imported
  only when a Subscriber starts (the `kvroute[events]` extra).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from typing import Any

from ._backend import backend as _backend
from .reference.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    MalformedBatch,
    decode,
    normalize_hash,
)

EventApplier = _backend.EventApplier

END_SEQ = b"\xff" * 8
"""Sequence frame of a replay's end marker."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One engine publisher and the replica id its events apply to.

    endpoint: the engine's PUB endpoint (e.g. "tcp://10.0.0.5:5557"); with bind=True the
    address this subscriber binds for an engine whose publisher connects (an endpoint
    without "*"). replay_endpoint: the engine's ROUTER replay endpoint, or None (gaps then
    resync). topic: subscription prefix; "" receives every topic.
    """

    replica: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False


@dataclasses.dataclass
class _Track:
    source: Source
    last_seq: int = -1
    last_ts: float | None = None
    batches: int = 0
    malformed: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    restarts: int = 0
    duplicates: int = 0
    bad_frames: int = 0
    errors: int = 0
    last_exception: str | None = None


class Subscriber:
    """Feeds engine KV event streams into an EventApplier from a background thread.

    Subscriber(applier, sources, *, replay_timeout=1.0, poll_interval=0.05). Use start() and
    stop(), or `with Subscriber(...) as sub:`. Per publisher it expects sequence numbers
    last+1; on a jump it requests the missing ones from the replay endpoint (DEALER; reply
    layouts [seq, payload] and [topic, seq, payload], with or without the empty delimiter,
    end marker END_SEQ or an empty payload). When there is no replay endpoint, the replay
    times out, or its first batch is later than the one missing, it clears the replica
    (applier.clear_replica) and counts a resync, then goes on from what it has. A sequence
    number back to 0 means the engine restarted: the replica is cleared and followed anew.
    Older numbers are duplicates and dropped. The first batch seen from a publisher at
    sequence k > 0 is a gap from 0. Malformed frames or payloads are counted and skipped.
    After a resync the replica knows only blocks stored since: a later store whose parent
    came before the gap has an unknown parent, so its batch is skipped (counted malformed)
    until the engine's chains restart from the root or it clears its cache.
    """

    def __init__(
        self,
        applier: Any,
        sources: Iterable[Source],
        *,
        replay_timeout: float = 1.0,
        poll_interval: float = 0.05,
    ) -> None:
        srcs = list(sources)
        seen: set[int] = set()
        for s in srcs:
            if not isinstance(s, Source):
                raise TypeError(f"sources must be Source objects, got {type(s).__name__}")
            if s.replica in seen:
                raise ValueError(f"replica {s.replica} has more than one source")
            seen.add(s.replica)
        if not replay_timeout > 0 or not poll_interval > 0:
            raise ValueError("replay_timeout and poll_interval must be positive")
        self._applier = applier
        self._tracks = {s.replica: _Track(s) for s in srcs}
        self._replay_timeout = float(replay_timeout)
        self._poll_ms = max(1, int(poll_interval * 1000))
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._endpoints: dict[int, str] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Subscriber:
        """Open the sockets in a background thread; returns once they are connected/bound."""
        if self._thread is not None:
            raise RuntimeError("subscriber already started")
        import zmq  # noqa: F401 - fail here, in the caller's thread, when pyzmq is missing

        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="kvroute-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"subscriber could not start: {self._error}") from self._error
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Subscriber:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def endpoints(self) -> dict[int, str]:
        """Replica -> the endpoint its SUB socket actually uses (the bound port for tcp://*:0)."""
        with self._cond:
            return dict(self._endpoints)

    # -- observation ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Counters: per replica (batches, malformed, gaps, replays, replayed_batches,
        resyncs, restarts, duplicates, bad_frames, errors and last_exception (exceptions
        raised while applying, e.g. for a removed replica id), last_seq, lag = now - engine
        ts of the last batch, in seconds, or None) and the applier's totals under "applier"."""
        now = time.time()
        with self._cond:
            replicas: dict[int, dict[str, Any]] = {}
            for r, t in self._tracks.items():
                replicas[r] = {
                    "endpoint": t.source.endpoint,
                    "last_seq": t.last_seq,
                    "batches": t.batches,
                    "malformed": t.malformed,
                    "gaps": t.gaps,
                    "replays": t.replays,
                    "replayed_batches": t.replayed_batches,
                    "resyncs": t.resyncs,
                    "restarts": t.restarts,
                    "duplicates": t.duplicates,
                    "bad_frames": t.bad_frames,
                    "errors": t.errors,
                    "last_exception": t.last_exception,
                    "lag": None if t.last_ts is None else now - t.last_ts,
                }
            totals = {k: sum(v[k] for v in replicas.values()) for k in (
                "batches", "malformed", "gaps", "replays", "resyncs", "restarts")}
        return {"replicas": replicas, **totals, "applier": self._applier.stats(), "running": self.running}

    def wait_for_seq(self, replica: int, seq: int, timeout: float | None = None) -> bool:
        """Block until the replica's publisher has been followed up to `seq`; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            track = self._tracks[replica]
            while track.last_seq < seq:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        socks: dict[Any, _Track] = {}
        try:
            try:
                for t in self._tracks.values():
                    s = ctx.socket(zmq.SUB)
                    socks[s] = t  # registered first so that `finally` closes it if bind fails
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SUBSCRIBE, t.source.topic.encode("utf-8"))
                    if t.source.bind:
                        s.bind(t.source.endpoint)
                        where = s.getsockopt_string(zmq.LAST_ENDPOINT)
                    else:
                        s.connect(t.source.endpoint)
                        where = t.source.endpoint
                    with self._cond:
                        self._endpoints[t.source.replica] = where
            except Exception as exc:  # noqa: BLE001 - reported by start()
                self._error = exc
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            while not self._stop.is_set():
                for s, _ in poller.poll(self._poll_ms):
                    # Drain without blocking so that one busy publisher cannot starve the stop flag.
                    for _ in range(1024):
                        try:
                            frames = s.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        t = socks[s]
                        try:
                            self._on_message(ctx, t, frames)
                        except Exception as exc:  # noqa: BLE001 - e.g. the replica id was removed
                            # One bad delivery must not end the thread that follows every engine.
                            with self._cond:
                                t.errors += 1
                                t.last_exception = f"{type(exc).__name__}: {exc}"
        finally:
            for s in socks:
                s.close(0)
            ctx.term()

    def _on_message(self, ctx: Any, t: _Track, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            with self._cond:
                t.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        r = t.source.replica
        expected = t.last_seq + 1
        if seq == expected:
            self._deliver(t, seq, payload)
            return
        if seq < expected:
            if seq == 0:
                # The engine restarted: what we knew of its cache is gone with it.
                self._applier.clear_replica(r)
                with self._cond:
                    t.restarts += 1
                    t.last_seq = -1
                self._deliver(t, seq, payload)
            else:
                with self._cond:
                    t.duplicates += 1
            return
        with self._cond:
            t.gaps += 1
        covered = False
        if t.source.replay_endpoint is not None:
            got = self._replay(ctx, t.source.replay_endpoint, expected)
            if got and got[0][0] == expected:
                covered = True
                with self._cond:
                    t.replays += 1
                for s2, p2 in got:
                    if s2 == t.last_seq + 1:
                        self._deliver(t, s2, p2, replayed=True)
                if t.last_seq + 1 < seq:
                    covered = False  # the replay stopped short of this message
        if not covered:
            self._applier.clear_replica(r)
            with self._cond:
                t.resyncs += 1
        if seq > t.last_seq:
            with self._cond:
                t.last_seq = seq - 1
            self._deliver(t, seq, payload)
        else:
            with self._cond:
                t.duplicates += 1

    def _deliver(self, t: _Track, seq: int, payload: bytes, replayed: bool = False) -> None:
        ok = self._applier.apply(t.source.replica, payload)
        ts = None
        if ok:
            ts = self._applier.replica_stats(t.source.replica)["last_ts"]
        with self._cond:
            t.last_seq = seq
            t.batches += 1
            if replayed:
                t.replayed_batches += 1
            if not ok:
                t.malformed += 1
            elif ts is not None:
                t.last_ts = ts
            self._cond.notify_all()

    def _replay(self, ctx: Any, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        """Batches from `start` on, as the replay endpoint returns them (possibly none)."""
        import zmq

        # A fresh DEALER per request, so late replies to an abandoned request cannot mix in.
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            d.connect(endpoint)
            d.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not d.poll(int(left * 1000) + 1):
                    return out if out and self._contiguous(out) else []
                frames = d.recv_multipart()
                # Layouts: [seq, payload], [topic, seq, payload], each maybe after b"".
                if len(frames) < 2 or len(frames[-2]) != 8:
                    continue
                seq_b, payload = frames[-2], frames[-1]
                if seq_b == END_SEQ or not payload:
                    return out if self._contiguous(out) else []
                out.append((int.from_bytes(seq_b, "big"), payload))
                deadline = time.monotonic() + self._replay_timeout
        finally:
            d.close(0)

    @staticmethod
    def _contiguous(got: list[tuple[int, bytes]]) -> bool:
        return all(got[i + 1][0] == got[i][0] + 1 for i in range(len(got) - 1))


__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventApplier",
    "EventBatch",
    "MalformedBatch",
    "Source",
    "Subscriber",
    "decode",
    "normalize_hash",
]
