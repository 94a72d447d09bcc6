"""A circuit breaker per replica, on an explicit clock.

closed --failure--> open (for `backoff`, doubling on each failed probe up to `max_backoff`)
open --backoff elapsed, probe admitted--> half_open --success--> closed (backoff reset)
                                                    --failure--> open (longer)
A replica is routable only while closed. The gateway probes an open replica with GET /health
once its period has elapsed (half-open); requests never go to it until a probe succeeds.
"""

from __future__ import annotations

import dataclasses

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}
"""The kvroute_breaker_state gauge's values."""


@dataclasses.dataclass
class Breaker:
    """State of one replica's breaker; `opened` counts transitions to open."""

    backoff: float = 1.0
    max_backoff: float = 30.0
    state: str = CLOSED
    period: float = 0.0
    until: float = 0.0
    opened: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.backoff <= self.max_backoff:
            raise ValueError(f"breaker backoff must be in (0, max_backoff], got {self.backoff!r}")

    @property
    def routable(self) -> bool:
        """Whether requests may go to the replica."""
        return self.state == CLOSED

    def failure(self, now: float) -> bool:
        """A request or probe failed; returns True when the breaker (re)opened."""
        if self.state == OPEN:
            return False  # requests already in flight when it opened: one period is enough
        self.period = self.backoff if self.state == CLOSED else min(self.period * 2, self.max_backoff)
        self.state, self.until = OPEN, now + self.period
        self.opened += 1
        return True

    def success(self) -> bool:
        """A probe (or a request) succeeded; returns True when the breaker closed."""
        if self.state != HALF_OPEN:
            return False
        self.state, self.period = CLOSED, 0.0
        return True

    def probe_due(self, now: float) -> bool:
        """Whether a probe should go out now; an open breaker whose period elapsed turns half-open."""
        if self.state == OPEN and now >= self.until:
            self.state = HALF_OPEN
        return self.state != OPEN
