"""A minimal cache-aware proxy for tests: a kvroute Router in front of emulated engines.

POST /v1/completions with a token-id prompt is routed by `router.route(tokens)` (precise
mode: the router's index is fed by a Subscriber following the engines' KV events), then
forwarded to the chosen engine with aiohttp and streamed back byte for byte;
`prefill_done` is called at the first streamed token and `finish` when the response
ends, as a gateway would. Runs on the emulated fleet's event loop (FleetThread).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn

from kvroute.events import EventApplier, Source, Subscriber


class _Server(uvicorn.Server):
    def capture_signals(self) -> Any:  # no signal handling in a test thread
        import contextlib

        return contextlib.nullcontext()


class RouterProxy:
    """ASGI app routing completions to engines; `names[i]` is engine i's replica name."""

    def __init__(self, router: Any, engines: list[Any], names: list[str], *, sessions: bool = False,
                 clock: Any = None) -> None:
        self.router = router
        self.urls = {router.replica_id(n): e.url for n, e in zip(names, engines)}
        self.sessions = sessions
        self.clock = clock
        self.applier = EventApplier(router.index, router.config.block_size)
        self.subscriber = Subscriber(self.applier, [
            Source(router.replica_id(n), e.events_endpoint, replay_endpoint=e.replay_endpoint)
            for n, e in zip(names, engines)])
        self.http: Any = None
        self.server: Any = None
        self.decisions: list[Any] = []

    async def start(self, port: int) -> None:
        """Subscribe, then listen on 127.0.0.1:port (call on the fleet's loop)."""
        import aiohttp

        self.subscriber.start()
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.server = _Server(uvicorn.Config(self, host="127.0.0.1", port=port, loop="none", http="httptools",
                                             lifespan="off", log_level="warning", access_log=False))
        task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        self._task = task

    async def stop(self) -> None:
        """Stop listening and subscribing."""
        self.server.should_exit = True
        await self._task
        await self.http.close()
        self.subscriber.stop()

    def _now(self) -> float | None:
        return None if self.clock is None else self.clock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if scope["path"] != "/v1/completions":
            url = next(iter(self.urls.values()))
            async with self.http.request(scope["method"], url + scope["path"], data=body or None) as resp:
                data = await resp.read()
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", resp.headers.get("content-type", "").encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        tokens = json.loads(body)["prompt"]
        session = headers.get("x-session-id") if self.sessions else None
        d = self.router.route(tokens, session=session, now=self._now())
        self.decisions.append(d)
        try:
            await self._forward(self.urls[d.replica_id], body, d.handle, send)
        finally:
            self.router.finish(d.handle, now=self._now())

    async def _forward(self, url: str, body: bytes, handle: int, send: Any) -> None:
        async with self.http.post(url + "/v1/completions", data=body,
                                  headers={"content-type": "application/json"}) as resp:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", resp.headers.get("content-type", "").encode())]})
            first = True
            async for chunk in resp.content.iter_any():
                if first and b'"text":"' in chunk:
                    self.router.prefill_done(handle, now=self._now())
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
