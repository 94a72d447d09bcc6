"""`kvroute serve`: the gateway as one raw ASGI app.

Why raw ASGI on uvicorn (uvloop + httptools) with an aiohttp client: the request path is one
dict lookup to a handler that reads the body, tokenizes, routes and relays upstream chunks
as ASGI messages; Starlette's Request/Response objects and router would add allocations per
request and per chunk without giving the proxy anything it needs, and aiohttp's pooled
connector keeps keep-alive connections to every engine (one client library for the gateway
and `kvroute bench`).

Routes: POST /v1/chat/completions, POST /v1/completions (proxy.py), GET /v1/models (the
union of the replicas'), GET /health, GET /metrics, /kvroute/replicas (admin.py),
GET /kvroute/diagnostics (kvroute.diagnose.Diagnostics: miss-ratio curves, volatile
prefixes, cold/warm TTFT of the traffic routed so far), GET /kvroute/state (the shared
state's link and counters, the snapshots').
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from .. import Router, RouterConfig
from ..diagnose.live import Diagnostics
from ..tokenize import load_tokenizer
from .admin import PREFIX, Admin
from .asgi import HTTPError, Receive, Scope, Send, respond, respond_error
from .config import GatewayConfig
from .fleet import Fleet
from .load import parse_load, parse_models
from .metrics import GatewayMetrics
from .prompt import LocalTokens, chat_request, completion_prompt
from .proxy import Proxy, UpstreamError
from .snapshots import Snapshots
from .state import make_state

log = logging.getLogger("kvroute.gateway")
INDEX_CAPACITY = 1 << 20
"""Blocks per replica the router's index holds (LRU beyond it): 16M tokens at block size 16."""
MODELS_EVERY = 10
"""Scrapes between two /v1/models refreshes."""


class EngineTokens:
    """`--tokenizer engine`: the engines' own /tokenize (vLLM's shape), one round trip."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.http: aiohttp.ClientSession | None = None
        self._next = 0

    async def _ask(self, payload: Mapping[str, Any]) -> Any:
        reps = [r for r in self.fleet.replicas.values() if r.breaker.routable]
        self._next += 1
        for i in range(min(2, len(reps))):
            rep = reps[(self._next + i) % len(reps)]
            try:
                assert self.http is not None
                async with self.http.post(rep.spec.url + "/tokenize", json=payload) as resp:
                    if resp.status == 200:
                        tokens = (await resp.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
        raise UpstreamError("tokenize")

    async def chat(self, body: Mapping[str, Any], session: str | None) -> Any:
        """Ids of a chat request from an engine."""
        messages, kwargs = chat_request(body)
        payload = {"model": body.get("model"), "messages": messages,
                   "add_generation_prompt": kwargs.pop("add_generation_prompt")}
        if kwargs.get("tools") is not None:
            payload["tools"] = kwargs.pop("tools")
        try:
            return await self._ask(payload)
        except UpstreamError as e:
            raise HTTPError(502, "no engine could tokenize the request") from e

    async def completion(self, body: Mapping[str, Any]) -> Any:
        """Ids of a completions request (token ids are used as given)."""
        prompt = completion_prompt(body)
        if not isinstance(prompt, str):
            return prompt
        try:
            return await self._ask({"model": body.get("model"), "prompt": prompt})
        except UpstreamError as e:
            raise HTTPError(502, "no engine could tokenize the request") from e


class Gateway:
    """The ASGI app. Replicas are added at construction (subscribers start then); the HTTP
    client, scrape and health loops start with the ASGI lifespan and stop with it."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        rc = RouterConfig(policy=config.policy, params=dict(config.policy_params), block_size=config.block_size,
                          salt=config.salt, mode=config.routing_mode, index_capacity=INDEX_CAPACITY)
        self.router = Router(rc, [])
        self.metrics = GatewayMetrics(events_status=lambda: self.fleet.events_status())
        self.fleet = Fleet(self.router, config, self.metrics)
        if config.tokenizer == "engine":
            self.tokens: Any = EngineTokens(self.fleet)
        else:
            self.tokens = LocalTokens(load_tokenizer(config.tokenizer), config.max_sessions)
        self._log_file = self._open_log(config.decision_log)
        self.diagnostics = Diagnostics(config.block_size)
        self.proxy = Proxy(self.fleet, self.metrics, self.tokens, session_header=config.session_header,
                           retries=config.retries, decision_log=self._log_file, diagnostics=self.diagnostics)
        self.admin = Admin(self.fleet)
        self.http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        for spec in config.replicas:
            self.fleet.add(spec, follow=False)
            self.diagnostics.add_replica(spec.name)
        self.snapshots = None if config.state_dir is None else Snapshots(
            self.router, self.fleet, config.state_dir, config.snapshot_interval)
        # Restore before any subscriber runs, then follow each engine from its saved cursor.
        cursors = self.snapshots.restore() if self.snapshots is not None else {}
        for rep in self.fleet.replicas.values():
            self.fleet.follow(rep, cursors.get(rep.spec.name))
        self.state = make_state(config.state, self.router, self.metrics, prefix=config.state_prefix,
                                timeout=config.state_timeout, load_interval=config.state_load_interval,
                                load_ttl=config.state_load_ttl, session_ttl=rc.session_ttl)
        self.proxy.state = self.state
        self._routes = {
            ("POST", "/v1/chat/completions"): lambda s, r, w: self.proxy.handle("chat", "/v1/chat/completions", s, r, w),
            ("POST", "/v1/completions"): lambda s, r, w: self.proxy.handle("completion", "/v1/completions", s, r, w),
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/kvroute/diagnostics"): self._diagnostics,
            ("GET", "/kvroute/state"): self._state,
        }

    @staticmethod
    def _open_log(path: str | None) -> Any:
        if path is None:
            return None
        return sys.stderr if path == "-" else open(path, "a", buffering=1, encoding="utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            handler = self._routes.get((scope["method"], path))
            try:
                if handler is not None:
                    await handler(scope, receive, send)
                elif path.startswith(PREFIX):
                    await self.admin.handle(scope, receive, send)
                else:
                    known = any(p == path for _, p in self._routes)
                    raise HTTPError(405 if known else 404, f"{scope['method']} {path} is not served here")
            except HTTPError as e:
                await respond_error(send, e)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- lifespan ------------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        """Open the upstream connection pool and start the scrape and health loops."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.read_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        self.http = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                          skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
        self.proxy.http = self.http
        if isinstance(self.tokens, EngineTokens):
            self.tokens.http = self.http
        self._tasks = [asyncio.ensure_future(self._scrape_loop()), asyncio.ensure_future(self._health_loop())]
        if self.snapshots is not None:
            self._tasks.append(asyncio.ensure_future(self.snapshots.run()))
        await self.state.start()

    async def stop(self) -> None:
        """Stop the loops and the sharing, close the pool, stop the subscribers, write the
        last snapshot (uvicorn has drained requests)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.state.stop()
        if self.http is not None:
            await self.http.close()
            self.http = None
        self.fleet.stop_following()
        if self.snapshots is not None:
            await self.snapshots.save()
        self.fleet.close()
        if self._log_file not in (None, sys.stderr):
            self._log_file.close()

    # -- background --------------------------------------------------------------------------------

    async def _get(self, url: str, timeout: float) -> tuple[int, bytes]:
        assert self.http is not None
        async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def _scrape_one(self, rep: Any, models: bool) -> None:
        t = min(self.config.scrape_interval * 2, 5.0)
        try:
            status, body = await self._get(rep.spec.url + "/metrics", t)
            if status == 200:
                load = parse_load(body.decode("utf-8", "replace"))
                if load and rep.spec.name in self.fleet.replicas:
                    self.router.report_load(rep.spec.name, **load)
                    rep.reported = load
            if models:
                status, body = await self._get(rep.spec.url + "/v1/models", t)
                if status == 200:
                    self.fleet.set_models(rep, *parse_models(json.loads(body)))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            rep.scrape_errors += 1

    async def _scrape_loop(self) -> None:
        n = 0
        while True:
            reps = list(self.fleet.replicas.values())
            await asyncio.gather(*(self._scrape_one(r, n % MODELS_EVERY == 0) for r in reps))
            n += 1
            await asyncio.sleep(self.config.scrape_interval)

    async def _probe(self, rep: Any) -> None:
        try:
            status, _ = await self._get(rep.spec.url + "/health", min(self.config.health_interval * 2, 5.0))
            ok = status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if rep.spec.name in self.fleet.replicas:
            self.fleet.probe_result(rep, ok)

    async def _health_loop(self) -> None:
        while True:
            now = time.monotonic()
            due = [r for r in list(self.fleet.replicas.values()) if r.breaker.probe_due(now)]
            for r in due:
                r.metrics.breaker_state(r.breaker.state)
            await asyncio.gather(*(self._probe(r) for r in due))
            await asyncio.sleep(self.config.health_interval)

    # -- simple routes -----------------------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not any(r.models for r in self.fleet.replicas.values()):
            await asyncio.gather(*(self._scrape_one(r, True) for r in list(self.fleet.replicas.values())))
        seen: dict[str, Any] = {}
        for rep in self.fleet.replicas.values():
            for m in rep.models:
                seen.setdefault(m["id"], m)
        await respond(send, 200, {"object": "list", "data": list(seen.values())})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        routable = sum(1 for r in self.fleet.replicas.values() if r.breaker.routable)
        status = 200 if routable else 503
        await respond(send, status, {"status": "ok" if routable else "unavailable", "routable": routable,
                                     "replicas": len(self.fleet.replicas)})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.tokens.encoder.stats if isinstance(self.tokens, LocalTokens) else None
        if st is not None:  # counters follow the encoder's own
            _sync(self.metrics.tokenizer_reuse, st.reused_tokens)
            _sync(self.metrics.tokenizer_encoded, st.encoded_tokens)
        await respond(send, 200, self.metrics.render(), [(b"content-type", b"text/plain; version=0.0.4")])

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        snaps = None if self.snapshots is None else self.snapshots.status()
        await respond(send, 200, {"state": self.state.status(), "snapshots": snaps})

    async def _diagnostics(self, scope: Scope, receive: Receive, send: Send) -> None:
        live = set(self.fleet.replicas)
        for name in self.diagnostics.replica_names():
            if name not in live:  # removed through the admin API since
                self.diagnostics.remove_replica(name)
        await respond(send, 200, self.diagnostics.snapshot())


def _sync(counter: Any, total: int) -> None:
    delta = total - counter._value.get()
    if delta > 0:
        counter.inc(delta)
