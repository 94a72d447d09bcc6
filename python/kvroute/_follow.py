"""Following one engine publisher's sequence numbers: the subscriber's rules, without ZMQ.

A `Follower` decides, for every live message and every replay reply of one publisher,
whether to apply it, hold it, drop it, ask for a replay, clear the replica or start over.
It never blocks: replays are requested through `ops.request(start)` and their replies are
fed back one by one as they stream (`on_reply`, `on_end`), so one publisher's replay never
holds up another's events. `kvroute.events.Subscriber` drives one Follower per publisher
from its thread; `tick(now)` runs the timers (replay timeouts, tail probes).

Rules (kv-events.md A1 and D: sequence numbers are 8-byte big-endian, from 0 per publisher
process, +1 per batch; the replay ROUTER answers every batch still in its ring from the
requested number on, then an end marker, and may lose replies to its send high-water mark):

- In order (last + 1): applied.
- A live number at or below the previous live number: the live stream went back, so the
  publisher restarted. A live number at or below the last applied that is not the echo of
  a batch applied from a replay (same number, same bytes): also a restart. A restart
  clears the replica, then follows the new process from 0 (replayed where the ring has it).
- A live number beyond last + 1: a gap. Without a replay endpoint the replica is cleared (a
  resync) and followed from that number. With one, the message is held and a replay asked.
- A replay asks from the last applied number (the anchor), whose bytes must come back
  identical: different bytes, or nothing at all from the anchor on, mean the publisher
  restarted. Every reply that continues the replica is applied as it arrives, and held
  messages drain behind it; a reply beyond a hole is held. When the round ends (end
  marker, idle timeout or total time limit) with numbers still missing, it is asked again
  from the first missing one. The replica is cleared only when the ring no longer holds
  the anchor or the first missing number (its first reply is later), or after
  `max_attempts` rounds in a row that applied nothing; it is then followed from the ring's
  first batch, or from the newest contiguous batches held.
- Held batches (live messages during a replay, replies beyond a hole) are capped at
  `max_buffer_bytes` (payload bytes + 64 per batch): the highest numbers are dropped
  first, since they can be asked again later.
- A publisher silent for `probe_interval` seconds (a replay endpoint known, no replay in
  flight) is probed with a replay from its last number, which recovers batches lost at the
  end of a burst (tail loss) and notices a restart whose batches were all lost. A new PUB
  connection (the driver watches the socket's connects) is probed at once, which notices a
  restarted process even when its first batch to arrive carries the number expected next;
  where nothing can be checked (no replay endpoint, or no batch applied since a resync) a
  new connection clears the replica and follows the publisher anew (a resync).
- Resume (`resume(seq, digest)`, before anything else; contract C8): the replica's state
  was restored from a snapshot taken right after batch `seq`, whose payload has
  `digest(payload) == digest`. That batch is the anchor of a replay asked at once (live
  batches held meanwhile): it comes back with the same digest: the same process, whose
  later batches are applied from the reply on; the ring no longer holds it (the first
  reply is later): cleared and followed from that reply; other bytes, an earlier number,
  nothing from it on, or no answer: cleared and followed anew. Without a replay endpoint
  the replica is cleared at once. Every such clear counts as one resync, not a restart. A new
  connection while the anchor is being verified is checked like any other: its probe must
  find the anchor's bytes, or the replica starts over.
  `cursor()` is {"seq", "digest"} of the last batch applied (or resumed from), else None.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Protocol

import xxhash

_ENTRY_OVERHEAD = 64
_ECHO_LIMIT = 16384


class Ops(Protocol):
    """What a Follower asks its driver to do (the Subscriber's thread implements it)."""

    def deliver(self, seq: int, payload: bytes) -> None:
        """Apply one batch to the replica."""

    def clear(self) -> None:
        """Forget everything the replica holds."""

    def request(self, start: int) -> None:
        """Open a replay from `start` on, replacing any open one."""

    def cancel(self) -> None:
        """Close the open replay, if any; its later replies must not be fed back."""


@dataclasses.dataclass
class Counters:
    """Per-publisher counters (Subscriber.status() reports them)."""

    batches: int = 0
    replayed_batches: int = 0
    gaps: int = 0
    replays: int = 0
    partial_replays: int = 0
    replay_timeouts: int = 0
    probes: int = 0
    probe_recoveries: int = 0
    resyncs: int = 0
    restarts: int = 0
    duplicates: int = 0
    buffer_drops: int = 0
    reconnects: int = 0


@dataclasses.dataclass
class _Round:
    """One replay request in flight."""

    anchor: int | None  # the last applied number, asked first to verify the process
    anchor_digest: int | None  # digest() of its payload
    probe: bool
    started: float
    active: float
    verify: bool = False  # after a new connection or a resume: hold live batches until it answers
    resume: bool = False  # asked by resume(): a ring without the anchor still continues the snapshot
    first: bool = True  # no reply yet
    progress: bool = False  # applied at least one batch


def digest(payload: bytes) -> int:
    """XXH3-64 of a batch's payload bytes: what a cursor's "digest" holds."""
    return xxhash.xxh3_64_intdigest(payload)


_digest = digest


class Follower:
    """Sequence state of one publisher (see the module docstring for the rules).

    Follower(ops, *, replay, max_attempts, max_buffer_bytes, replay_timeout,
    replay_max_seconds, probe_interval): `replay` says whether a replay endpoint exists.
    Not thread-safe: one driver thread calls it.
    """

    def __init__(self, ops: Ops, *, replay: bool, max_attempts: int, max_buffer_bytes: int,
                 replay_timeout: float, replay_max_seconds: float,
                 probe_interval: float | None, now: float = 0.0) -> None:
        self._ops = ops
        self._replay = replay
        self._max_attempts = max_attempts
        self._cap = max_buffer_bytes
        self._idle = replay_timeout
        self._max_seconds = replay_max_seconds
        self._probe = probe_interval
        self.c = Counters()
        self.last_seq = -1
        self._last_payload: bytes | None = None  # of last_seq, when applied here
        self._resumed_digest: int | None = None  # of last_seq, when resumed from a cursor
        self._resuming = False  # resumed and the anchor not verified yet
        self._cleared = False  # resume cleared the replica: a first batch beyond 0 loses nothing more
        self._live_max = -1  # highest live number received from this process
        self._seen_max = -1  # highest number known to exist in this process
        self._floor = -1  # numbers up to here were skipped by a resync: their echoes are old
        self._held: dict[int, bytes] = {}
        self._heap: list[int] = []  # -seq of held batches (lazy: may hold released ones)
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        self._echo: dict[int, int] = {}  # replayed numbers above the live stream -> digest
        self._round: _Round | None = None
        self._attempts = 0
        self._heard = now
        self._verify = False  # a new connection to check as soon as no replay is in flight

    @property
    def replaying(self) -> bool:
        """Whether a replay (or probe) is in flight."""
        return self._round is not None

    # -- inputs ---------------------------------------------------------------------------

    def on_live(self, seq: int, payload: bytes, now: float) -> None:
        """One message from the PUB stream."""
        self._heard = now
        if self._went_back(seq, payload):
            self._restart()
        elif seq <= self.last_seq:
            self.c.duplicates += 1
            return
        self._live_max = seq
        self._seen_max = max(self._seen_max, seq)
        r = self._round
        if seq == self.last_seq + 1 and (r is None or not (r.verify and r.first)):
            self._apply(seq, payload, replayed=False)
            self._drain()
        elif r is not None:
            self._hold(seq, payload)
        elif self._replay:
            self.c.gaps += 1
            self._hold(seq, payload)
            self._start(now, probe=False)
        else:
            if self._cleared:  # already cleared and counted by resume()
                self.last_seq = self._floor = seq - 1
            else:
                self.c.gaps += 1
                self._resync(seq - 1)
            self._apply(seq, payload, replayed=False)

    def on_reply(self, seq: int, payload: bytes, now: float) -> None:
        """One batch of the open replay, in the order received."""
        r = self._round
        if r is None:
            return
        r.active = now
        if r.first:
            r.first = False
            if r.anchor is not None and seq <= r.anchor:
                if seq < r.anchor or _digest(payload) != r.anchor_digest:
                    self._restart()  # same number, other bytes: another process
                    self._start(now, probe=False)
                else:
                    self._resuming = False  # the anchor checked out: the same process
                return
            if r.anchor is not None and r.verify and not r.resume:
                # A new connection and the ring no longer holds our last number: nothing
                # tells whether this is the same process (even while resuming: the snapshot's
                # process may be gone). Start over.
                self._restart(counter="resyncs")
                self._start(now, probe=False)
                return
            if r.anchor is not None or seq > self.last_seq + 1:
                # The ring no longer holds our last number (so nothing tells whether this is
                # still the same process) or what is missing: what came before is lost.
                self._resync(seq - 1)
        self._seen_max = max(self._seen_max, seq)
        if seq == self.last_seq + 1:
            self._apply(seq, payload, replayed=True)
            r.progress = True
            self._drain()
        elif seq > self.last_seq + 1:
            self._hold(seq, payload)

    def on_end(self, now: float) -> None:
        """The open replay's end marker."""
        r = self._round
        if r is None:
            return
        if r.first and r.anchor is not None:
            self._ops.cancel()
            self._round = None
            self._restart()  # nothing from our last number on: the numbers went back
            self._start(now, probe=False)
            return
        self._round_over(r, now)

    def on_reconnect(self, now: float, *, exclusive: bool = True) -> None:
        """The PUB connection was made again: the publisher may be a new process, whose
        first batch may even carry the number we expect next. Held batches (from before)
        are dropped, and the publisher is probed from our last number (its bytes tell)
        before anything of it is applied; where nothing can be checked (no replay endpoint,
        or no batch applied since a resync) the replica starts over. `exclusive`: the
        connection can only be this publisher's (we connect to it; a bound socket may also
        be reached by other publishers, whose connections prove nothing)."""
        self.c.reconnects += 1
        if self._round is not None:
            # Asked of whichever process was there: ask the one there now instead.
            self._ops.cancel()
            self._round = None
        self._drop_held()
        if exclusive and (not self._replay or self._anchor_digest() is None):
            if self.last_seq >= 0:
                self._restart(counter="resyncs")
            else:
                self._forget()
        if self._replay:
            self._verify = True
            self.tick(now)

    def resume(self, seq: int, digest: int, now: float) -> None:
        """The replica holds what batches up to `seq` (payload digest `digest`) left, restored
        from a snapshot: verify by a replay from `seq` before applying anything, or clear
        (one resync) when that cannot be done. Call it before any other input."""
        if not self._replay:
            self._ops.clear()
            self.c.resyncs += 1
            self._cleared = True
            return
        self.last_seq = self._seen_max = seq
        self._last_payload = None
        self._resumed_digest = digest
        self._resuming = True
        self._start(now, probe=False, verify=True, resume=True)

    def cursor(self) -> dict[str, int] | None:
        """{"seq", "digest"} of the last batch applied (or resumed from), else None."""
        d = self._anchor_digest()
        if self.last_seq < 0 or d is None:
            return None
        return {"seq": self.last_seq, "digest": d}

    def tick(self, now: float) -> None:
        """Timers: a replay idle or running too long ends; a silent publisher is probed."""
        r = self._round
        if r is not None:
            if now - r.active >= self._idle or now - r.started >= self._max_seconds:
                self.c.replay_timeouts += 1
                self._round_over(r, now)
        elif self._replay and (self._verify or (self._probe is not None
                                                 and now - self._heard >= self._probe)):
            verify, self._verify = self._verify, False
            self._start(now, probe=True, verify=verify)

    def next_deadline(self) -> float | None:
        """The monotonic time of the next timer, or None."""
        r = self._round
        if r is not None:
            return min(r.active + self._idle, r.started + self._max_seconds)
        if self._replay and self._verify:
            return 0.0  # due now
        if self._replay and self._probe is not None:
            return self._heard + self._probe
        return None

    # -- rules ----------------------------------------------------------------------------

    def _went_back(self, seq: int, payload: bytes) -> bool:
        if seq <= self._live_max:
            return True
        if seq > self.last_seq:
            return False
        while self._echo and next(iter(self._echo)) < seq:
            del self._echo[next(iter(self._echo))]
        d = self._echo.pop(seq, None)
        if d is not None:
            return d != _digest(payload)
        return seq > self._floor

    def _anchor_digest(self) -> int | None:
        if self._last_payload is not None:
            return _digest(self._last_payload)
        return self._resumed_digest

    def _start(self, now: float, *, probe: bool, verify: bool = False, resume: bool = False) -> None:
        d = self._anchor_digest() if self.last_seq >= 0 else None
        anchor = self.last_seq if d is not None else None
        self._round = _Round(anchor, d, probe, now, now, verify=verify, resume=resume)
        if probe:
            self.c.probes += 1
        else:
            self.c.replays += 1
        self._ops.request(self.last_seq + 1 if anchor is None else anchor)

    def _round_over(self, r: _Round, now: float) -> None:
        self._ops.cancel()
        self._round = None
        self._heard = now
        if r.verify and r.first and r.anchor is not None:
            # A new connection whose publisher cannot be checked: start over.
            self._restart(counter="resyncs")
            return
        self._drain()
        if self.last_seq >= self._seen_max:
            self._attempts = 0
            if r.probe and r.progress:
                self.c.probe_recoveries += 1
            return
        self.c.partial_replays += 1
        self._attempts = 0 if r.progress else self._attempts + 1
        if self._attempts >= self._max_attempts:
            self._give_up()
        else:
            self._start(now, probe=False)

    def _give_up(self) -> None:
        """Clear and follow on from the newest batches held that reach the live stream."""
        s = self._live_max
        while s in self._held:
            s -= 1
        s = max(s, self.last_seq)  # never back over what is applied
        self._attempts = 0
        self._resync(s)
        self._drain()
        self._drop_held()  # what is left lies beyond a hole
        self._seen_max = self.last_seq

    def _resync(self, last: int) -> None:
        self._ops.clear()
        self.c.resyncs += 1
        self.last_seq = last
        self._floor = max(self._floor, last)
        self._last_payload = self._resumed_digest = None
        self._resuming = False
        self._echo.clear()
        for s in [s for s in self._held if s <= last]:
            self._release(s)

    def _restart(self, counter: str = "restarts") -> None:
        self._ops.cancel()
        self._round = None
        self._ops.clear()
        if self._resuming:
            counter = "resyncs"  # the snapshot's state could not be continued
        setattr(self.c, counter, getattr(self.c, counter) + 1)
        self._forget()

    def _forget(self) -> None:
        """Forget every number of the publisher, as for a new process."""
        self.last_seq = self._live_max = self._seen_max = self._floor = -1
        self._last_payload = self._resumed_digest = None
        self._resuming = False
        self._echo.clear()
        self._drop_held()
        self._attempts = 0

    def _drop_held(self) -> None:
        self._held.clear()
        self._heap.clear()
        self.buffered_bytes = 0

    # -- applying and holding -------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self._cleared = False
        self._release(seq)
        self.last_seq = seq
        self._last_payload = payload  # one batch per publisher: its digest is computed on demand
        self._resumed_digest = None
        if replayed:
            self.c.replayed_batches += 1
            if seq > self._live_max:
                self._echo[seq] = _digest(payload)
                if len(self._echo) > _ECHO_LIMIT:
                    del self._echo[next(iter(self._echo))]
        self.c.batches += 1
        self._ops.deliver(seq, payload)

    def _drain(self) -> None:
        while self.last_seq + 1 in self._held:
            s = self.last_seq + 1
            # Held numbers above the live stream came from a replay: their echoes may follow.
            self._apply(s, self._held[s], replayed=s > self._live_max)

    def _hold(self, seq: int, payload: bytes) -> None:
        if seq in self._held:
            return
        size = len(payload) + _ENTRY_OVERHEAD
        while self.buffered_bytes + size > self._cap and self._held:
            top = self._top()
            if top < seq:
                self.c.buffer_drops += 1
                return
            self._release(top)
            self.c.buffer_drops += 1
        if size > self._cap:
            self.c.buffer_drops += 1
            return
        self._held[seq] = payload
        heapq.heappush(self._heap, -seq)
        self.buffered_bytes += size
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)

    def _top(self) -> int:
        while -self._heap[0] not in self._held:
            heapq.heappop(self._heap)
        return -self._heap[0]

    def _release(self, seq: int) -> None:
        p = self._held.pop(seq, None)
        if p is None:
            return
        self.buffered_bytes -= len(p) + _ENTRY_OVERHEAD
        if not self._held:
            self._heap.clear()
        elif len(self._heap) > 2 * len(self._held) + 64:
            self._heap = [-s for s in self._held]
            heapq.heapify(self._heap)

    def snapshot(self) -> dict[str, Any]:
        """Counters and state as plain values."""
        out: dict[str, Any] = dataclasses.asdict(self.c)
        out.update(last_seq=self.last_seq, replaying=self.replaying,
                   buffered_bytes=self.buffered_bytes, buffered_batches=len(self._held),
                   peak_buffered_bytes=self.peak_buffered_bytes)
        return out
