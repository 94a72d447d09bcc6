"""Sharing sessions, load and route-time inserts between gateways through Redis.

Keys (all under `prefix`, default "kvroute"; every gateway of one fleet uses the same
prefix, the same replica names and the same routing mode):

- sessions: `{prefix}:session:{id}` -> replica name, written after each routing decision
  with the router's session_ttl as expiry (every write slides it, as the router's own table
  does). Before routing a request with a session, the gateway GETs the key (bounded by
  `timeout`) and Router.bind_session's it when it differs from the local binding.
  Staleness: a binding is in Redis one writer flush after the decision that made it (the
  writer task sends as soon as the request path hands it over, coalescing what piled up
  during the previous send); another gateway reads it at its next request of that session.
- load: `{prefix}:load:{gateway}` -> JSON {t, own: {replica: [in_flight,
  queued_prefill_tokens, prefill_requests, prefill_blocks, decode_blocks]}} with a
  `load_ttl` expiry (default 2 s), rewritten every `load_interval` (default 0.1 s); the
  live gateways are found through the sorted set `{prefix}:gateways` (member: gateway id,
  score: wall time of its last write). Each gateway sums the others' records per replica
  into Router.set_external_load. Staleness: at most load_interval (the writer's period) +
  load_interval (the reader's) + two round trips; a gateway that dies stops counting within
  load_ttl + load_interval.
- route-time inserts (approximate and hybrid modes): the stream `{prefix}:routes`, capped
  at about `stream_maxlen` entries (XADD MAXLEN ~), one entry {g: gateway, r: replica,
  h: block hashes as uint64 LE} per decision; each gateway follows it with a blocking XREAD
  and applies the others' entries through Router.observe_route (hybrid: into the
  speculative index, with its TTL). Staleness: one writer flush plus one XREAD wake-up.
  Precise mode shares no index: every gateway follows every engine's KV events itself.

Faults (link.RedisLink): while Redis is slow or gone nothing is shared, the other gateways'
load is forgotten at once (each router goes on with its own), queued writes are dropped
(counted), and no request waits longer than `timeout` (a request only waits on the session
lookup, and not at all while the link is down). When Redis answers again, the load
exchange resumes at its next tick, the stream is followed from its newest entry (inserts
made during the outage are not replayed: missing them can only under-claim), and
sessions are written again from the next decision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import logging
import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from .base import SharedState
from .link import RedisLink

log = logging.getLogger("kvroute.gateway.state")
LOAD_FIELDS = ("in_flight", "queued_prefill_tokens", "prefill_requests", "prefill_blocks", "decode_blocks")
LOAD_MAX = 1 << 40
"""Router.set_external_load's bound on each figure."""
BATCH = 512
"""Writes per pipeline (a bigger backlog goes in several)."""
READ_MARGIN = 1.0
"""Seconds a blocking XREAD may overrun its BLOCK time before the link counts as down: the
reader is a background task, so a loaded host's scheduling delay must not flap the link
(the request path's session lookup keeps the short timeout)."""
PEER_WINDOW = 60.0
"""Seconds a gateway stays in the {prefix}:gateways set after its last write (its load key
expires much sooner; the set only lists whose key to read)."""


@dataclasses.dataclass(frozen=True)
class RedisOptions:
    """RedisState settings (seconds). queue_max bounds the writes waiting for Redis, session
    bindings and route inserts each (oldest dropped beyond it, counted); gateway_id defaults to
    host:pid:random."""

    prefix: str = "kvroute"
    timeout: float = 0.05
    load_interval: float = 0.1
    load_ttl: float = 2.0
    stream_maxlen: int = 10_000
    read_block: float = 0.1
    session_ttl: float = 600.0
    queue_max: int = 65_536
    backoff: float = 0.1
    max_backoff: float = 2.0
    gateway_id: str | None = None

    def __post_init__(self) -> None:
        for key in ("timeout", "load_interval", "load_ttl", "read_block", "session_ttl", "backoff", "max_backoff"):
            if not getattr(self, key) > 0:
                raise ValueError(f"state {key} must be > 0, got {getattr(self, key)!r}")
        if self.load_ttl <= self.load_interval:
            raise ValueError(f"state load_ttl ({self.load_ttl}) must exceed load_interval ({self.load_interval})")
        if self.stream_maxlen < 1 or self.queue_max < 1:
            raise ValueError("state stream_maxlen and queue_max must be >= 1")
        if not self.prefix:
            raise ValueError("state prefix must not be empty")


class RedisState(SharedState):
    """Sessions, load and route-time inserts shared through one Redis (module docstring)."""

    kind = "redis"

    def __init__(self, url: str, router: Any, metrics: Any, options: RedisOptions | None = None) -> None:
        self.opts = opts = options or RedisOptions()
        self.router = router
        self.metrics = metrics
        if metrics is not None:
            metrics.enable_state()
        self.gateway_id = opts.gateway_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._gid = self.gateway_id.encode()
        p = opts.prefix
        self._session_prefix = f"{p}:session:".encode()
        self._load_prefix = f"{p}:load:".encode()
        self._gateways_key = f"{p}:gateways".encode()
        self._stream = f"{p}:routes".encode()
        self.share_routes = router.config.mode != "precise"
        self.link = RedisLink(url, timeout=opts.timeout, backoff=opts.backoff, max_backoff=opts.max_backoff,
                              metrics=metrics)
        self.link.on_down.append(self._on_down)
        self._sessions: dict[str, bytes] = {}
        self._routes: list[tuple[bytes, bytes]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._external: dict[str, tuple[int, ...]] = {}
        self.counts = {"sessions_adopted": 0, "sessions_written": 0, "routes_published": 0, "routes_applied": 0,
                       "routes_unknown_replica": 0, "dropped": 0, "peers": 0}

    # -- lifespan --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (bounded), then run the writer, the load exchange and the stream reader."""
        await self.link.start()
        self._tasks = [asyncio.ensure_future(self._writer()), asyncio.ensure_future(self._load_loop())]
        if self.share_routes:
            self._tasks.append(asyncio.ensure_future(self._reader()))

    async def stop(self) -> None:
        """Flush nothing more; stop the tasks, delete this gateway's load record, close."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.link.call(lambda c: c.delete(self._load_prefix + self._gid), what="load delete")
        await self.link.close()

    def status(self) -> dict[str, Any]:
        """Link state and counters."""
        return {"kind": self.kind, "url": self.link.url, "gateway": self.gateway_id, "up": self.link.up,
                "outages": self.link.outages, "errors": self.link.errors, "last_error": self.link.last_error,
                "share_routes": self.share_routes, "queued": len(self._sessions) + len(self._routes),
                **self.counts}

    # -- request path ----------------------------------------------------------------------------

    async def before_route(self, session: str | None) -> None:
        """Adopt another gateway's binding of `session` (waits at most `timeout`; not at all when down)."""
        if not session or not self.link.up:
            return
        try:
            key = self._session_prefix + session.encode()
        except UnicodeEncodeError:
            return  # the router refuses the id with a clear error
        value = await self.link.call(lambda c: c.get(key), what="session get")
        if value is None:
            return
        name = value.decode("utf-8", "replace")
        try:
            if self.router.session(session) != name:
                self.router.bind_session(session, name)
                self.counts["sessions_adopted"] += 1
        except (KeyError, ValueError):
            pass  # a replica this gateway does not have (yet), or an id the router refuses

    def routed(self, session: str | None, replica: str, hashes: Any) -> None:
        """Queue the decision for the writer (returns at once; dropped while Redis is down)."""
        if not self.link.up:
            return
        if session:
            self._sessions[session] = replica.encode()
            if len(self._sessions) > self.opts.queue_max:  # the same bound as the routes'
                del self._sessions[next(iter(self._sessions))]
                self._dropped(1)
        if self.share_routes and len(hashes):
            self._routes.append((replica.encode(), np.ascontiguousarray(hashes, dtype="<u8").tobytes()))
            if len(self._routes) > self.opts.queue_max:
                drop = len(self._routes) - self.opts.queue_max
                del self._routes[:drop]
                self._dropped(drop)
        self._wake.set()

    def _dropped(self, n: int) -> None:
        self.counts["dropped"] += n
        if self.metrics is not None:
            self.metrics.state_dropped.inc(n)

    def _on_down(self) -> None:
        self._dropped(len(self._sessions) + len(self._routes))
        self._sessions, self._routes = {}, []
        self._set_external({})  # others' load is unknown now: each router goes on with its own
        self.counts["peers"] = 0
        if self.metrics is not None:
            self.metrics.state_peers.set(0)

    # -- writer ------------------------------------------------------------------------------------

    async def _writer(self) -> None:
        ttl_ms = max(1, int(self.opts.session_ttl * 1000))
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.link.up and (self._sessions or self._routes):
                sessions = list(self._sessions.items())[:BATCH]
                for s, _ in sessions:
                    del self._sessions[s]
                routes = self._routes[:BATCH - len(sessions)]
                del self._routes[:len(routes)]
                await self._send(sessions, routes, ttl_ms)

    async def _send(self, sessions: list[tuple[str, bytes]], routes: list[tuple[bytes, bytes]], ttl_ms: int) -> None:
        prefix, gid, stream, maxlen = self._session_prefix, self._gid, self._stream, self.opts.stream_maxlen

        async def send(c: Any) -> Any:
            pipe = c.pipeline(transaction=False)
            for s, r in sessions:
                pipe.set(prefix + s.encode("utf-8", "surrogatepass"), r, px=ttl_ms)
            for r, h in routes:
                pipe.xadd(stream, {b"g": gid, b"r": r, b"h": h}, maxlen=maxlen, approximate=True)
            return await pipe.execute()

        if await self.link.call(send, what="publish") is None:
            self._dropped(len(sessions) + len(routes))
            return
        self.counts["sessions_written"] += len(sessions)
        self.counts["routes_published"] += len(routes)

    # -- load -------------------------------------------------------------------------------------

    def _own_load(self) -> dict[str, list[int]]:
        out = {}
        for name in self.router.replicas:
            own = self.router.load(name)["own"]
            out[name] = [int(own[k]) for k in LOAD_FIELDS]
        return out

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opts.load_interval)
            if self.link.up:
                await self._exchange_load()

    async def _exchange_load(self) -> None:
        now = time.time()
        record = json.dumps({"t": now, "own": self._own_load()}).encode()
        ttl_ms, gid, key, zkey = int(self.opts.load_ttl * 1000), self._gid, self._load_prefix, self._gateways_key

        async def exchange(c: Any) -> Any:
            pipe = c.pipeline(transaction=False)
            pipe.set(key + gid, record, px=ttl_ms)
            pipe.zadd(zkey, {gid: now})
            pipe.zremrangebyscore(zkey, "-inf", now - PEER_WINDOW)
            pipe.zrangebyscore(zkey, now - PEER_WINDOW, "+inf")
            peers = [g for g in (await pipe.execute())[3] if g != gid]
            return await c.mget([key + g for g in peers]) if peers else []

        records = await self.link.call(exchange, what="load")
        if records is None:
            return
        self._apply_peers(records, now)

    def _apply_peers(self, records: list[Any], now: float) -> None:
        sums: dict[str, list[int]] = {}
        live, oldest = 0, 0.0
        for raw in records:
            if raw is None:
                continue  # expired: that gateway stopped publishing
            parsed = _peer_record(raw)
            if parsed is None:
                continue  # not a record any gateway writes: ignored whole
            t, own = parsed
            live += 1
            oldest = max(oldest, now - t)
            for name, figures in own.items():
                acc = sums.setdefault(name, [0] * len(LOAD_FIELDS))
                for i, v in enumerate(figures):
                    acc[i] += v
        self._set_external(sums)
        self.counts["peers"] = live
        if self.metrics is not None:
            self.metrics.state_peers.set(live)
            self.metrics.state_load_age.set(max(0.0, oldest))

    def _set_external(self, sums: dict[str, list[int]]) -> None:
        zero = (0,) * len(LOAD_FIELDS)
        for name in self.router.replicas:
            figures = tuple(min(v, LOAD_MAX) for v in sums.get(name, zero))
            if self._external.get(name, zero) == figures:
                continue
            try:
                self.router.set_external_load(name, **dict(zip(LOAD_FIELDS, figures)))
                self._external[name] = figures
            except KeyError:
                self._external.pop(name, None)  # removed since

    # -- route stream -------------------------------------------------------------------------------

    async def _reader(self) -> None:
        last: bytes | None = None
        block_ms = max(1, int(self.opts.read_block * 1000))
        while True:
            if not self.link.up:
                last = None
                await self.link.wait_up()
            if last is None:  # (re)start at the newest entry: an outage's inserts are not replayed
                newest = await self.link.call(lambda c: c.xrevrange(self._stream, count=1), what="routes read")
                if newest is None and not self.link.up:
                    continue
                last = newest[0][0] if newest else b"0-0"
            res = await self.link.call(lambda c: c.xread({self._stream: last}, count=BATCH, block=block_ms),
                                       timeout=self.opts.read_block + READ_MARGIN, what="routes read")
            if res:
                last = self._apply_routes(res, last)

    def _apply_routes(self, res: Any, last: bytes) -> bytes:
        entries = res.get(self._stream, [[]])[0] if isinstance(res, dict) else res[0][1]
        now_ms = time.time() * 1000
        for entry_id, fields in entries:
            last = entry_id
            if fields.get(b"g") == self._gid:
                continue
            try:
                hashes = np.frombuffer(fields[b"h"], dtype="<u8")
                self.router.observe_route(fields[b"r"].decode(), hashes)
            except (KeyError, ValueError, TypeError, UnicodeDecodeError):
                self.counts["routes_unknown_replica"] += 1
                continue
            self.counts["routes_applied"] += 1
            if self.metrics is not None:
                self.metrics.state_route_delay.observe(max(0.0, now_ms - int(entry_id.split(b"-")[0])) / 1000)
        return bytes(last)


def _peer_record(raw: Any) -> tuple[float, dict[str, list[int]]] | None:
    """(time, {replica: load figures, each an int >= 0}) of another gateway's load record, or
    None when it is not one (bad JSON, a missing, non-finite or non-numeric field): a peer's
    bad record must not stop the load exchange, nor count half."""
    try:
        rec = json.loads(raw)
        t = float(rec["t"])
        own: dict[str, list[int]] = {}
        for name, figures in rec["own"].items():
            if not isinstance(figures, list):
                return None
            own[str(name)] = [max(0, int(v)) for v in figures[:len(LOAD_FIELDS)]]
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None
    return (t, own) if math.isfinite(t) else None
