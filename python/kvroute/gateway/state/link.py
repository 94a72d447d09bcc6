"""One gateway's connection to Redis, with the rule that Redis never holds a request up.

Every command goes through `RedisLink.call(fn, timeout=)`: it runs only while the link is
up and gives up after `timeout` seconds (asyncio.wait_for; redis-py drops a connection whose
read was cancelled). Any error or timeout marks the link down: one warning is logged for the
whole outage, `kvroute_state_redis_up` drops to 0, `kvroute_state_redis_errors` counts the
error, and from then on `call` returns None at once (no request waits while Redis is gone).
A background task pings with exponential backoff (`backoff` doubling up to `max_backoff`);
the first answer brings the link up again (logged once) and the callbacks in `on_up` run so
the owner can resume sharing. redis-py's own retries are off: a retry would wait inside a
request's time budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvroute.gateway.state")


class RedisLink:
    """A redis.asyncio client, up/down state, bounded calls and reconnection."""

    def __init__(self, url: str, *, timeout: float, backoff: float = 0.1, max_backoff: float = 2.0,
                 metrics: Any = None, max_connections: int = 64) -> None:
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.timeout = timeout
        self.backoff, self.max_backoff = backoff, max_backoff
        self.metrics = metrics  # GatewayMetrics or None
        # A blocking pool: under a burst, commands wait for a free connection (within their
        # timeout) instead of failing with "too many connections" and taking the link down.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, socket_connect_timeout=max(timeout, 0.001),
            retry=Retry(NoBackoff(), 0), decode_responses=False)
        self.client = aioredis.Redis(connection_pool=pool)
        self.up = False
        self.outages = 0
        self.errors = 0
        self.last_error: str | None = None
        self.on_up: list[Callable[[], None]] = []
        self.on_down: list[Callable[[], None]] = []
        self._probe: asyncio.Task[None] | None = None
        self._closed = False
        self._up_event = asyncio.Event()

    async def start(self) -> None:
        """First contact, bounded by the timeout; down (and probing) if Redis does not answer."""
        if await self._ping():
            self._set_up()
        else:
            self._went_down("no answer at start")

    async def close(self) -> None:
        """Stop probing and close the connection pool."""
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        try:
            await asyncio.wait_for(self.client.aclose(close_connection_pool=True), 1.0)
        except Exception:  # noqa: BLE001 - closing a pool to a dead server may fail; nothing to do
            pass

    async def wait_up(self) -> None:
        """Return once the link is up."""
        await self._up_event.wait()

    async def call(self, fn: Callable[[Any], Awaitable[Any]], *, timeout: float | None = None,
                   what: str = "command") -> Any:
        """fn(client) within `timeout` (default: the link's); None when down, failed or late."""
        if not self.up:
            return None
        try:
            return await asyncio.wait_for(fn(self.client), self.timeout if timeout is None else timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a timeout, connection or server error: all mean "go local"
            self.error(what, e)
            return None

    def error(self, what: str, exc: BaseException) -> None:
        """Count an error and mark the link down."""
        self.errors += 1
        self.last_error = f"{what}: {type(exc).__name__}: {exc}".rstrip(": ")
        if self.metrics is not None:
            self.metrics.state_errors.labels(what).inc()
        if self.up:
            self._went_down(self.last_error)

    def _went_down(self, why: str) -> None:
        self.up = False
        self._up_event.clear()
        self.outages += 1
        if self.metrics is not None:
            self.metrics.state_up.set(0)
            self.metrics.state_outages.inc()
        log.warning("redis %s unreachable (%s): going on with local state until it answers", self.url, why)
        for cb in self.on_down:
            cb()
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.ensure_future(self._reconnect())

    def _set_up(self) -> None:
        self.up = True
        self._up_event.set()
        if self.metrics is not None:
            self.metrics.state_up.set(1)
        for cb in self.on_up:
            cb()

    async def _ping(self) -> bool:
        try:
            await asyncio.wait_for(self.client.ping(), self.timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.last_error = f"ping: {type(e).__name__}: {e}".rstrip(": ")
            return False

    async def _reconnect(self) -> None:
        delay = self.backoff
        while not self._closed:
            await asyncio.sleep(delay)
            try:  # pooled connections to a restarted server are dead: start afresh
                await asyncio.wait_for(self.client.connection_pool.disconnect(), self.timeout)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                pass
            if await self._ping():
                log.warning("redis %s answers again: sharing resumes", self.url)
                self._set_up()
                return
            delay = min(delay * 2, self.max_backoff)
