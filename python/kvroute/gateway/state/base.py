"""The interface between one gateway and the state it may share with other gateways.

A gateway calls `before_route(session)` before routing a request that names a session
(adopt a binding another gateway made), `routed(session, replica, hashes)` after each
routing decision (publish it; never waits), and `start()` / `stop()` with its lifespan.
`LocalState` shares nothing (one gateway, today's behaviour); `RedisState`
(kvroute.gateway.state.redis_store) shares sessions, load and route-time inserts through
Redis.
"""

from __future__ import annotations

from typing import Any


class SharedState:
    """What several gateways in front of one fleet share. The base class is the local
    backend: nothing is shared and every call returns at once."""

    kind = "local"

    async def start(self) -> None:
        """Begin sharing (background tasks); never fails for want of the store."""

    async def stop(self) -> None:
        """Stop the background tasks and close connections."""

    async def before_route(self, session: str | None) -> None:
        """Adopt the store's binding of `session` into the router (bounded wait)."""

    def routed(self, session: str | None, replica: str, hashes: Any) -> None:
        """A request was routed to `replica` (its block hashes; its session, if any)."""

    def status(self) -> dict[str, Any]:
        """Counters and state for GET /kvroute/state."""
        return {"kind": self.kind}


class LocalState(SharedState):
    """No sharing: each gateway's router knows only its own sessions, load and routes."""


def make_state(url: str | None, router: Any, metrics: Any, **options: Any) -> SharedState:
    """The backend for `--state`: None or "local" -> LocalState; redis://host:port/db (or
    rediss://, unix://) -> RedisState with `options` (kvroute.gateway.state.RedisOptions fields)."""
    if url is None or url == "local":
        return LocalState()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisOptions, RedisState

        return RedisState(url, router, metrics, RedisOptions(**options))
    raise ValueError(f"state must be 'local' or a redis:// URL, got {url!r}")
