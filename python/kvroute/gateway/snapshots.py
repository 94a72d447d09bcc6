"""`kvroute serve --state-dir DIR`: a warm restart from the router's last snapshot.

At start (before any subscriber follows an engine and before the first request) the gateway
restores DIR/router.kvrsnap with Router.restore (contract C7; with the fleet's EventApplier
in precise/hybrid mode): the index, sessions and the applier's maps come back, replicas in
the file that the configuration no longer names are removed again, and each followed
replica's subscriber starts from the saved cursor (contract C8: the engine replays what
came after it, or the replica is cleared when the engine no longer has it). A refused file
(corrupt, truncated, another block size or salt) is logged and the gateway starts cold.

Then a snapshot is written every `snapshot_interval` seconds and once more at shutdown, in a
worker thread (Router.snapshot copies the index replica by replica and writes path.tmp,
then renames: a crash mid-write leaves the previous file). The subscribers are held between
batches during Router.snapshot (Fleet.paused; ~90 ms for 800,000 blocks plus the fsync;
their events queue in ZMQ meanwhile), so the file's index, applier maps and cursors name
exactly the same batches: a restore replays from the first batch the file does not hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

log = logging.getLogger("kvroute.gateway")
FILE = "router.kvrsnap"


class Snapshots:
    """Restore at start and snapshot periodically and at shutdown for one gateway."""

    def __init__(self, router: Any, fleet: Any, directory: str, interval: float) -> None:
        self.router, self.fleet, self.interval = router, fleet, interval
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, FILE)
        self.restored: dict[str, Any] | None = None
        self.refused: str | None = None
        self.written = 0
        self.last_seconds: float | None = None
        self.last_error: str | None = None

    def restore(self) -> dict[str, dict[str, int]]:
        """Restore the file if there is one; returns the cursors by replica name ({} when cold)."""
        if not os.path.exists(self.path):
            return {}
        try:
            info = self.router.restore(self.path, applier=self.fleet.applier)
        except (ValueError, OSError) as e:
            self.refused = str(e)
            log.warning("snapshot %s refused (%s): starting cold", self.path, e)
            return {}
        configured = set(self.fleet.replicas)
        for name in info.get("replicas", []):
            if name not in configured and name in self.router.replicas:  # the configuration decides
                if self.fleet.applier is not None:
                    self.fleet.applier.clear_replica(self.router.replica_id(name))
                self.router.remove_replica(name)
        self.restored = info
        log.warning("snapshot %s restored: %d blocks, %d sessions, written %.1f s ago", self.path,
                    info.get("blocks", 0), info.get("sessions", 0), info.get("age", float("nan")))
        return {k: v for k, v in dict(info.get("cursors", {})).items() if k in configured}

    async def run(self) -> None:
        """Snapshot every `interval` seconds (until cancelled)."""
        while True:
            await asyncio.sleep(self.interval)
            await self.save()

    async def save(self) -> bool:
        """One snapshot, written in a worker thread; False (logged) if it failed."""
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._write)
        except (OSError, ValueError, RuntimeError) as e:
            if self.last_error is None:
                log.warning("snapshot %s failed: %s", self.path, e)
            self.last_error = str(e)
            return False
        self.last_seconds = time.perf_counter() - t0
        self.written += 1
        self.last_error = None
        return True

    def _write(self) -> None:
        """Router.snapshot with every subscriber held, so that cursors and state agree."""
        with self.fleet.paused() as cursors:
            self.router.snapshot(self.path, applier=self.fleet.applier, cursors=cursors)

    def status(self) -> dict[str, Any]:
        """For GET /kvroute/state."""
        restored = None if self.restored is None else {k: self.restored.get(k) for k in ("blocks", "sessions", "age")}
        return {"path": self.path, "interval": self.interval, "written": self.written,
                "last_seconds": self.last_seconds, "last_error": self.last_error, "restored": restored,
                "refused": self.refused}
