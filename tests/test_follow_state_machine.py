"""kvroute._follow.Follower (the subscriber's sequence rules) against a model publisher, with
no ZMQ and an explicit clock, so that hypothesis can try many thousands of interleavings of
losses, restarts, holey, truncated or silent replays and timeouts.

Safety, after every step: since the replica was last cleared, the batches applied are
consecutive numbers of one publisher process. (With event-level application that is what
keeps the index from claiming a block its engine dropped: nothing between two applied
batches was skipped, and nothing of another process was mixed in.)
Liveness, whenever replays are answered fully and time passes: the follower reaches the
publisher's newest number, holds nothing of an earlier process, and when no history was
lost (no resync since the process started) it has applied all of that process's batches.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvroute._follow import Follower, digest

PROBE = 1.0
IDLE = 0.5


class FakeOps:
    """Records what the follower does to the replica and which replay is open."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, int]] = []  # (process, seq) since the last clear
        self.open: int | None = None  # start of the open replay
        self.gen = 0

    def deliver(self, seq: int, payload: bytes) -> None:
        proc, s = map(int, payload.split(b":"))
        assert s == seq
        self.applied.append((proc, s))

    def clear(self) -> None:
        self.applied = []

    def request(self, start: int) -> None:
        self.open = start
        self.gen += 1

    def cancel(self) -> None:
        self.open = None
        self.gen += 1


class FollowerVsPublisher(RuleBasedStateMachine):
    @initialize(ring=st.integers(1, 12), attempts=st.integers(1, 3),
                cap=st.sampled_from([70, 200, 10_000]))
    def setup(self, ring, attempts, cap):
        self.ops = FakeOps()
        self.now = 0.0
        self.params = dict(replay=True, max_attempts=attempts, max_buffer_bytes=cap,
                           replay_timeout=IDLE, replay_max_seconds=3.0, probe_interval=PROBE)
        self.f = Follower(self.ops, **self.params)
        self.snap = None
        self.proc, self.seq = 0, 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self.resyncs_at_start = 0

    def _payload(self, seq: int) -> bytes:
        return f"{self.proc}:{seq}".encode()

    @rule(lost=st.lists(st.booleans(), min_size=1, max_size=5))
    def publish(self, lost):
        self._emit(lost)

    def _emit(self, lost):
        for gone in lost:
            p = self._payload(self.seq)
            self.ring.append((self.seq, p))
            if not gone:
                self.f.on_live(self.seq, p, self.now)
            self.seq += 1

    @rule(published_before_connect=st.integers(0, 3))
    def restart(self, published_before_connect):
        """A new process: numbers from 0; its first batches go out before the new
        connection is made (so they are lost), then the connection is seen."""
        self.proc += 1
        self.seq = 0
        self.ring.clear()
        self.resyncs_at_start = self.f.c.resyncs
        self._emit([True] * published_before_connect)
        self.f.on_reconnect(self.now)

    @precondition(lambda self: self.ops.open is not None)
    @rule(holes=st.sets(st.integers(0, 12), max_size=3), end=st.booleans(),
          cut=st.one_of(st.none(), st.integers(0, 12)))
    def answer_replay(self, holes, end, cut):
        """The ROUTER answers the open request: some replies lost, maybe cut short, maybe no
        end marker (the round then ends by timeout)."""
        gen, start = self.ops.gen, self.ops.open
        items = [(s, p) for s, p in self.ring if s >= start][:cut]
        for i, (s, p) in enumerate(items):
            if i in holes:
                continue
            self.f.on_reply(s, p, self.now)
            if self.ops.gen != gen:
                return  # the follower closed this replay (e.g. a restart was noticed)
        if end:
            self.f.on_end(self.now)

    @rule()
    def save_snapshot(self):
        """What a snapshot saves: the replica's state (applied since the last clear) and the
        cursor; whether that state is complete for the current process."""
        complete = self.f.c.resyncs == self.resyncs_at_start
        self.snap = (self.f.cursor(), list(self.ops.applied), self.proc, complete)

    @precondition(lambda self: self.snap is not None)
    @rule()
    def restore_snapshot(self):
        """The subscriber restarts from the saved state and resumes from its cursor (C8):
        the publisher may have gone on, lost the anchor from its ring, or restarted."""
        cursor, applied, proc, complete = self.snap
        self.ops = FakeOps()
        self.ops.applied = list(applied)
        self.f = Follower(self.ops, **self.params, now=self.now)
        if cursor is not None:
            self.f.resume(cursor["seq"], cursor["digest"], self.now)
        # Still the process of the snapshot, whose state was complete: no resync, no loss.
        self.resyncs_at_start = 0 if complete and proc == self.proc else -1

    @rule(dt=st.sampled_from([0.1, IDLE, PROBE, 3.0]))
    def time_passes(self, dt):
        self.now += dt
        self.f.tick(self.now)

    @rule()
    def settle(self):
        """Replays answered in full and time passing: the follower must catch up, and a
        probe begun after this point (it checks the last number's bytes) must complete."""
        probes = self.f.c.probes + (self.ops.open is not None)
        for _ in range(50):
            if self.ops.open is not None:
                gen, start = self.ops.gen, self.ops.open
                for s, p in [(s, p) for s, p in self.ring if s >= start]:
                    self.f.on_reply(s, p, self.now)
                    if self.ops.gen != gen:
                        break
                else:
                    self.f.on_end(self.now)
            elif self.f.last_seq == self.seq - 1 and self.f.c.probes > probes:
                break
            else:
                self.now += PROBE
                self.f.tick(self.now)
        assert self.ops.open is None and self.f.last_seq == self.seq - 1
        applied = self.ops.applied
        assert all(p == self.proc for p, _ in applied)
        if self.f.c.resyncs == self.resyncs_at_start:
            assert applied == [(self.proc, s) for s in range(self.seq)]
        assert self.f.buffered_bytes == 0

    @invariant()
    def applied_is_one_process_in_order(self):
        a = self.ops.applied
        assert len({p for p, _ in a}) <= 1, a
        assert all(a[i + 1][1] == a[i][1] + 1 for i in range(len(a) - 1)), a
        if a:
            assert a[-1][1] == self.f.last_seq
        assert self.f.buffered_bytes <= self.f._cap
        cursor = self.f.cursor()
        if cursor is None:
            assert a == [], a  # nothing applied since the last clear
        else:
            assert a, cursor  # a cursor always names the last batch the state holds
            p, s = a[-1]
            assert cursor == {"seq": s, "digest": digest(f"{p}:{s}".encode())}


# Pure Python and fast: the profile's example count (HYPOTHESIS_PROFILE), longer runs.
FollowerVsPublisher.TestCase.settings = settings(stateful_step_count=40, deadline=None)
test_follower_vs_publisher = FollowerVsPublisher.TestCase


def test_a_new_connection_while_resuming_is_checked_like_any_other():
    """Found by the machine above: the publisher restarted while a resumed follower was still
    verifying its snapshot's anchor. The new connection's probe finds the ring without the
    anchor; that must start over (a resync), not continue the snapshot from the new process's
    batches with the old process's numbers (it ended believing it was at 2, the new process
    at 1)."""
    m = FollowerVsPublisher()
    m.setup(ring=1, attempts=1, cap=70)
    m.publish([False, True])
    m.save_snapshot()
    m.restore_snapshot()
    m.publish([False])
    m.restart(published_before_connect=2)
    m.settle()
    assert m.f.last_seq == 1 and m.ops.applied == [(1, 1)] and m.f.c.resyncs >= 1


def _follower(replay):
    ops = FakeOps()
    f = Follower(ops, replay=replay, max_attempts=2, max_buffer_bytes=1000, replay_timeout=IDLE,
                 replay_max_seconds=3.0, probe_interval=PROBE)
    return ops, f


def test_without_replay_a_gap_resyncs_and_a_new_connection_starts_over():
    ops, f = _follower(replay=False)
    for s in range(3):
        f.on_live(s, f"0:{s}".encode(), 0.0)
    f.on_live(5, b"0:5", 0.0)  # 3 and 4 lost: cleared, followed on from 5
    assert ops.applied == [(0, 5)] and f.c.gaps == 1 and f.c.resyncs == 1
    f.on_reconnect(0.0)  # maybe a new process, nothing to check it against
    assert ops.applied == [] and f.c.resyncs == 2 and f.last_seq == -1
    f.on_live(0, b"1:0", 0.0)
    assert ops.applied == [(1, 0)] and f.c.restarts == 0
    f.tick(100.0)
    assert ops.open is None  # no replay endpoint: never probed


def test_a_connection_to_a_bound_socket_is_only_probed():
    ops, f = _follower(replay=True)
    for s in range(2):
        f.on_live(s, f"0:{s}".encode(), 0.0)
    f.on_reconnect(0.0, exclusive=False)  # another publisher reached our bound socket
    assert ops.open == 1 and ops.applied == [(0, 0), (0, 1)]
    f.on_live(2, b"0:2", 0.0)  # held until the probe answers
    assert ops.applied == [(0, 0), (0, 1)] and f.buffered_bytes > 0
    f.on_reply(1, b"0:1", 0.0)  # the anchor, unchanged: same process
    f.on_end(0.0)
    assert ops.applied == [(0, 0), (0, 1), (0, 2)] and f.c.restarts == f.c.resyncs == 0


# -- resume from a saved cursor (contract C8) -------------------------------------------------


def _resumed(seq=4, proc=0, replay=True):
    """A follower whose replica holds batches 0..seq of `proc` (restored), resumed."""
    ops, f = _follower(replay)
    ops.applied = [(proc, s) for s in range(seq + 1)]
    f.resume(seq, digest(f"{proc}:{seq}".encode()), 0.0)
    return ops, f


def test_resume_anchor_verified_continues_the_restored_state():
    ops, f = _resumed()
    assert ops.open == 4 and f.cursor() == {"seq": 4, "digest": digest(b"0:4")}
    f.on_live(7, b"0:7", 0.0)  # live batches wait for the anchor
    assert ops.applied[-1] == (0, 4) and f.buffered_bytes > 0
    for s in (4, 5, 6):
        f.on_reply(s, f"0:{s}".encode(), 0.0)
    f.on_end(0.0)
    assert ops.applied == [(0, s) for s in range(8)] and ops.open is None
    assert (f.c.resyncs, f.c.restarts, f.c.replays, f.c.replayed_batches) == (0, 0, 1, 2)
    assert f.cursor() == {"seq": 7, "digest": digest(b"0:7")}


def test_resume_anchor_with_other_bytes_clears_as_one_resync():
    ops, f = _resumed()
    f.on_reply(4, b"1:4", 0.0)  # a restarted engine numbered a batch 4 too
    assert ops.applied == [] and ops.open == 0 and f.cursor() is None
    assert (f.c.resyncs, f.c.restarts) == (1, 0)
    for s in range(6):
        f.on_reply(s, f"1:{s}".encode(), 0.0)
    f.on_end(0.0)
    assert ops.applied == [(1, s) for s in range(6)] and f.c.resyncs == 1


def test_resume_ring_lost_the_anchor_clears_and_follows_the_ring():
    ops, f = _resumed()
    f.on_reply(9, b"0:9", 0.0)  # the ring starts after the anchor
    f.on_reply(10, b"0:10", 0.0)
    f.on_end(0.0)
    assert ops.applied == [(0, 9), (0, 10)] and (f.c.resyncs, f.c.restarts) == (1, 0)


@pytest.mark.parametrize("how", ["nothing from the anchor on", "no answer", "live went back"])
def test_resume_unverifiable_clears_as_one_resync(how):
    ops, f = _resumed()
    if how == "nothing from the anchor on":
        f.on_end(0.0)  # a restarted engine with fewer batches than the anchor's number
    elif how == "no answer":
        f.tick(IDLE)  # the replay endpoint does not answer
    else:
        f.on_live(1, b"1:1", 0.0)  # the live stream is numbered below the anchor
    assert ops.applied == [] and (f.c.resyncs, f.c.restarts) == (1, 0)
    f.on_live(2, b"1:2", IDLE)  # then followed anew, as any fresh follower
    assert f.c.restarts == 0


def test_resume_without_replay_endpoint_clears_once():
    ops, f = _resumed(replay=False)
    assert ops.applied == [] and ops.open is None and f.c.resyncs == 1 and f.cursor() is None
    f.on_live(12, b"0:12", 0.0)  # joining mid-stream: nothing more is lost
    f.on_live(13, b"0:13", 0.0)
    assert ops.applied == [(0, 12), (0, 13)] and (f.c.resyncs, f.c.gaps) == (1, 0)
    f.on_live(15, b"0:15", 0.0)  # a real gap later still counts
    assert (f.c.resyncs, f.c.gaps) == (2, 1)
