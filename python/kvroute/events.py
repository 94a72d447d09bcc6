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
  publisher (connect, or bind where the engine connects) that follows each publisher's
  sequence numbers (rules in kvroute._follow): streamed replays over DEALER on a gap,
  applied as they arrive and asked again after a hole; resync (clear the replica) only
  when history is lost; restarts noticed when numbers go back or a replayed batch differs;
  tail probes of silent publishers; bounded buffers; resume from saved cursors after a
  restart (contract C8). pyzmq is imported only when a Subscriber starts (the
  `kvroute[events]` extra).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import contextlib
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ._backend import backend as _backend
from ._follow import Follower, digest
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


_BURST = 64  # messages taken from one socket before the others get a turn
_MIB = 1 << 20


def _reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply, (-1, b"") for the end marker, None if unreadable.

    Layouts (kv-events.md A1, D): [seq, payload] and [topic, seq, payload], each possibly
    after the empty delimiter; end marker END_SEQ or an empty payload."""
    if not 2 <= len(frames) <= 4 or len(frames[-2]) != 8:
        return None
    seq_b, payload = frames[-2], frames[-1]
    if seq_b == END_SEQ or not payload:
        return -1, b""
    return int.from_bytes(seq_b, "big"), payload


class _Track:
    """One publisher: its Follower, the replay socket it has open, and the applier's side."""

    def __init__(self, sub: Subscriber, source: Source, now: float) -> None:
        self.sub = sub
        self.source = source
        self.follower = Follower(
            self, replay=source.replay_endpoint is not None, max_attempts=sub._attempts,
            max_buffer_bytes=sub._max_buffer, replay_timeout=sub._replay_timeout,
            replay_max_seconds=sub._replay_max_seconds, probe_interval=sub._probe_interval,
            now=now)
        self.dealer: Any = None
        self.connects = 0
        self.last_ts: float | None = None
        self.malformed = 0
        self.bad_frames = 0
        self.errors = 0
        self.last_exception: str | None = None

    # Ops, called by the Follower from the subscriber's thread.

    def deliver(self, seq: int, payload: bytes) -> None:
        applier = self.sub._applier
        try:
            if applier.apply(self.source.replica, payload):
                ts = applier.replica_stats(self.source.replica)["last_ts"]
                if ts is not None:
                    self.last_ts = ts
            else:
                self.malformed += 1
        except Exception as exc:  # noqa: BLE001 - e.g. the replica id was removed
            # One bad delivery must not end the thread that follows every engine.
            self._error(exc)

    def clear(self) -> None:
        try:
            self.sub._applier.clear_replica(self.source.replica)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def request(self, start: int) -> None:
        import zmq

        self.cancel()
        # A fresh DEALER per request, so late replies to an abandoned request cannot mix in.
        d = self.sub._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.source.replay_endpoint)
        self.dealer = d
        try:
            d.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connectable now: the round times out and is counted
        self.sub._open(d, self)

    def cancel(self) -> None:
        if self.dealer is not None:
            self.sub._close(self.dealer)
            self.dealer = None

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_exception = f"{type(exc).__name__}: {exc}"

    def status(self, now: float) -> dict[str, Any]:
        out = self.follower.snapshot()
        out.update(endpoint=self.source.endpoint, malformed=self.malformed,
                   bad_frames=self.bad_frames, errors=self.errors,
                   last_exception=self.last_exception,
                   lag=None if self.last_ts is None else now - self.last_ts)
        return out


def _skipped(applier: Any, replica: int) -> dict[str, int] | None:
    """Events the applier skipped on this replica, by kind, when it reports them."""
    try:
        rs = applier.replica_stats(replica)
    except Exception:  # noqa: BLE001 - a removed replica id
        return None
    if isinstance(rs.get("skipped"), dict):
        return dict(rs["skipped"])
    found = {k[len("skipped_"):]: v for k, v in rs.items() if k.startswith("skipped_")}
    return found or None


class Subscriber:
    """Feeds engine KV event streams into an EventApplier from a background thread.

    Subscriber(applier, sources, *, replay_timeout=1.0, replay_max_seconds=30.0,
    replay_attempts=3, probe_interval=1.0, max_buffer_bytes=64 MiB, poll_interval=0.05,
    resume=None).
    Use start() and stop(), or `with Subscriber(...) as sub:`. One thread follows every
    publisher; nothing in it blocks on one publisher: replays (DEALER, both reply layouts)
    are read as they stream, between the other sockets' messages.

    Per publisher the rules of kvroute._follow apply: batches in order are applied; a gap
    asks a replay from the last applied number, applies every contiguous run as it arrives
    and asks again from the first missing number after a hole; the replica is cleared (a
    resync) only when the publisher's ring no longer holds that number, when there is no
    replay endpoint, or after `replay_attempts` rounds in a row that applied nothing. A
    round ends at its end marker, after `replay_timeout` seconds without a reply, or after
    `replay_max_seconds`. A live number that goes back, or a replayed anchor whose bytes
    differ, means the publisher restarted: the replica is cleared and the new process
    followed from 0 (replayed where its ring has it). Each new PUB connection (a socket
    monitor reports them) is verified by such a replay before any of its batches is
    applied, or, where it cannot be, starts the replica over. A publisher silent for
    `probe_interval` seconds (None: never) with a replay endpoint is probed for anything
    after its last number (tail loss). Batches held while waiting (live messages during a
    replay, replies beyond a hole) are capped at `max_buffer_bytes` per publisher, highest
    numbers dropped first. Malformed frames or payloads are counted and skipped.

    Warm restart (contract C8): `resume` maps replica ids to saved cursors {"seq": s,
    "digest": d} (what cursors() returned when the applier's state was saved, e.g. with
    Router.snapshot). For each, when the thread starts and before anything live is
    applied, the publisher's replay is asked for batch s: if it comes back with digest d
    (kvroute._follow.digest of its payload), the applier's restored state is continued
    from s + 1 (removals of blocks stored before the snapshot resolve); if the ring no
    longer holds s, the digest differs (the engine restarted) or there is no replay
    endpoint (or it does not answer), the replica is cleared, counted as one resync, and
    followed anew. cursors() gives the current cursors; paused() holds the thread between
    batches so that cursors and applier state can be saved consistently.
    """

    def __init__(
        self,
        applier: Any,
        sources: Iterable[Source],
        *,
        replay_timeout: float = 1.0,
        replay_max_seconds: float = 30.0,
        replay_attempts: int = 3,
        probe_interval: float | None = 1.0,
        max_buffer_bytes: int = 64 * _MIB,
        poll_interval: float = 0.05,
        resume: Mapping[int, Mapping[str, int]] | None = None,
    ) -> None:
        srcs = list(sources)
        seen: set[int] = set()
        for s in srcs:
            if not isinstance(s, Source):
                raise TypeError(f"sources must be Source objects, got {type(s).__name__}")
            if s.replica in seen:
                raise ValueError(f"replica {s.replica} has more than one source")
            seen.add(s.replica)
        for name, v in (("replay_timeout", replay_timeout), ("replay_max_seconds", replay_max_seconds),
                        ("poll_interval", poll_interval), ("probe_interval", probe_interval)):
            if v is None and name == "probe_interval":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name, v in (("replay_attempts", replay_attempts), ("max_buffer_bytes", max_buffer_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self._resume = _cursors_arg(resume, seen)
        self._applier = applier
        self._sources = srcs
        self._replay_timeout = float(replay_timeout)
        self._replay_max_seconds = float(replay_max_seconds)
        self._attempts = replay_attempts
        self._probe_interval = None if probe_interval is None else float(probe_interval)
        self._max_buffer = max_buffer_bytes
        self._poll_ms = max(1, int(poll_interval * 1000))
        now = time.monotonic()
        self._tracks = {s.replica: _Track(self, s, now) for s in srcs}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._endpoints: dict[int, str] = {}
        self._ctx: Any = None
        self._poller: Any = None
        self._socks: dict[Any, tuple[str, _Track]] = {}  # socket -> (kind, track)

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
        """Counters per replica and totals.

        Per replica: last_seq (last applied, -1 before any), lag (now - engine ts of the
        last applied batch, seconds, or None), batches, replayed_batches, gaps, replays
        (rounds asked for gaps), partial_replays (rounds that ended with numbers still
        missing and were asked again), replay_timeouts, probes, probe_recoveries (probes
        that found lost batches), restarts, resyncs (the replica cleared because history
        was lost), duplicates, buffer_drops, buffered_bytes / buffered_batches (held now),
        peak_buffered_bytes (the most ever held),
        replaying, reconnects (new PUB connections after the first; each is probed),
        malformed, bad_frames, errors and last_exception (exceptions raised
        while applying, e.g. for a removed replica id), skipped (events the applier skipped
        on it, by kind, where the applier reports them; else None), endpoint. Totals of the
        main counters at the top level, the applier's stats() under "applier"."""
        now = time.time()
        with self._cond:
            replicas = {r: t.status(now) for r, t in self._tracks.items()}
        for r, st in replicas.items():
            st["skipped"] = _skipped(self._applier, r)
        totals = {k: sum(v[k] for v in replicas.values()) for k in (
            "batches", "malformed", "gaps", "replays", "partial_replays", "resyncs", "restarts",
            "buffered_bytes")}
        return {"replicas": replicas, **totals, "applier": self._applier.stats(),
                "running": self.running}

    def cursors(self) -> dict[int, dict[str, int]]:
        """{replica id: {"seq", "digest"}} of the last batch applied (or resumed from) per
        replica; a replica without one (none applied since the start or a resync) is left
        out. Pass it as `resume` to a later Subscriber with the state saved alongside."""
        with self._cond:
            out = {r: t.follower.cursor() for r, t in self._tracks.items()}
        return {r: c for r, c in out.items() if c is not None}

    @contextlib.contextmanager
    def paused(self) -> Iterator[dict[int, dict[str, int]]]:
        """Hold the subscriber's thread between batches; yields cursors() for the applier
        state as it is inside the block (save both there, e.g. Router.snapshot(...,
        applier=, cursors=)). Keep it short: events queue meanwhile."""
        with self._cond:
            yield {r: c for r, t in self._tracks.items() if (c := t.follower.cursor()) is not None}

    def wait_for_seq(self, replica: int, seq: int, timeout: float | None = None, *,
                     settled: bool = False) -> bool:
        """Block until the replica's publisher has been followed up to `seq` (and, with
        settled=True, no replay is in flight and nothing is held); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            f = self._tracks[replica].follower
            while f.last_seq < seq or (settled and (f.replaying or f.buffered_bytes)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- the thread -----------------------------------------------------------------------

    def _open(self, sock: Any, track: _Track) -> None:
        import zmq

        self._socks[sock] = ("replay", track)
        self._poller.register(sock, zmq.POLLIN)

    def _close(self, sock: Any) -> None:
        if self._socks.pop(sock, None) is not None:
            self._poller.unregister(sock)
        sock.close(0)

    def _bind_all(self, zmq: Any) -> None:
        for t in self._tracks.values():
            s = self._ctx.socket(zmq.SUB)
            self._socks[s] = ("live", t)  # registered first so that `finally` closes it if bind fails
            s.setsockopt(zmq.LINGER, 0)
            # Connections made (engine PUB bound) or accepted (engine connects): after the
            # first, each one may be a restarted engine.
            mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
            self._socks[mon] = ("monitor", t)
            s.setsockopt(zmq.SUBSCRIBE, t.source.topic.encode("utf-8"))
            if t.source.bind:
                s.bind(t.source.endpoint)
                where = s.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                s.connect(t.source.endpoint)
                where = t.source.endpoint
            with self._cond:
                self._endpoints[t.source.replica] = where

    def _run(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        try:
            try:
                self._bind_all(zmq)
                self._resume_all()
            except Exception as exc:  # noqa: BLE001 - reported by start()
                self._error = exc
                return
            finally:
                self._ready.set()
            for s in self._socks:
                self._poller.register(s, zmq.POLLIN)
            while not self._stop.is_set():
                ready = [s for s, _ in self._poller.poll(self._wait_ms())]
                # Connection news first: it precedes every message on the new connection.
                ready.sort(key=lambda s: self._socks.get(s, ("",))[0] != "monitor")
                for s in ready:
                    self._serve(s, zmq)
                now = time.monotonic()
                with self._cond:
                    for t in self._tracks.values():
                        self._guard(t, t.follower.tick, now)
                    self._cond.notify_all()
        finally:
            for t in self._tracks.values():
                t.dealer = None  # closed below; a later start() opens fresh ones
            for s, (kind, _) in list(self._socks.items()):
                if kind == "live":
                    s.disable_monitor()
            for s in list(self._socks):
                s.close(0)
            self._socks.clear()
            self._ctx.term()

    def _resume_all(self) -> None:
        """Ask each resumed replica's anchor (once: a later start() follows on as usual)."""
        resume, self._resume = self._resume, {}
        now = time.monotonic()
        with self._cond:
            for r, cur in resume.items():
                t = self._tracks[r]
                self._guard(t, t.follower.resume, cur["seq"], cur["digest"], now)

    def _wait_ms(self) -> int:
        now = time.monotonic()
        with self._cond:
            due = [d for t in self._tracks.values() if (d := t.follower.next_deadline()) is not None]
        if not due:
            return self._poll_ms
        return max(0, min(self._poll_ms, int((min(due) - now) * 1000) + 1))

    def _serve(self, sock: Any, zmq: Any) -> None:
        """Take up to _BURST messages from one socket (then the others get their turn)."""
        for _ in range(_BURST):
            entry = self._socks.get(sock)
            if entry is None:
                return  # a replay closed while its replies were being read
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, t = entry
            with self._cond:
                if kind == "replay":
                    self._on_reply(t, frames)
                elif kind == "live":
                    self._on_live(t, frames)
                else:
                    self._on_monitor(t, frames)
                self._cond.notify_all()

    def _on_live(self, t: _Track, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            t.bad_frames += 1
            return
        self._guard(t, t.follower.on_live, int.from_bytes(frames[1], "big"), frames[2], time.monotonic())

    def _on_monitor(self, t: _Track, frames: list[bytes]) -> None:
        t.connects += 1
        if t.connects > 1:
            self._guard(t, lambda now: t.follower.on_reconnect(now, exclusive=not t.source.bind),
                        time.monotonic())

    def _on_reply(self, t: _Track, frames: list[bytes]) -> None:
        got = _reply(frames)
        if got is None:
            t.bad_frames += 1
        elif got[0] < 0:
            self._guard(t, t.follower.on_end, time.monotonic())
        else:
            self._guard(t, t.follower.on_reply, got[0], got[1], time.monotonic())

    @staticmethod
    def _guard(t: _Track, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - one publisher's trouble must not end the thread
            t._error(exc)


def _cursors_arg(resume: Any, replicas: set[int]) -> dict[int, dict[str, int]]:
    """Validated resume cursors: {replica: {"seq", "digest"}}, ints in [0, 2**64)."""
    if resume is None:
        return {}
    if not isinstance(resume, Mapping):
        raise TypeError(f"resume must be a mapping of replica id to cursor, got {type(resume).__name__}")
    out: dict[int, dict[str, int]] = {}
    for r, cur in resume.items():
        if r not in replicas:
            raise ValueError(f"resume has a cursor for replica {r!r}, which has no source")
        if not isinstance(cur, Mapping):
            raise TypeError(f"resume[{r!r}] must be a mapping with 'seq' and 'digest', got {type(cur).__name__}")
        fields = {}
        for key in ("seq", "digest"):
            if key not in cur:
                raise ValueError(f"resume[{r!r}] has no {key!r}")
            v = cur[key]
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"resume[{r!r}][{key!r}] must be an int, got {type(v).__name__}")
            v = operator.index(v)
            if not 0 <= v < (1 << 64):
                raise ValueError(f"resume[{r!r}][{key!r}] must be in [0, 2**64), got {v}")
            fields[key] = v
        out[r] = fields
    return out


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
    "digest",
    "normalize_hash",
]
