"""A minimal cache-aware proxy for tests: a kvroute Router in front of emulated engines.

POST /v1/completions with a token-id prompt is routed by `router.route(tokens)` (precise
mode: the router's index is fed by a Subscriber following the engines' KV events; before
each decision every engine's waiting/running/KV usage is reported, as the simulator's
fleet does with report_load), then
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
        self.engines = list(zip(names, engines))
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
        # The engines' load as a gateway scraping /metrics sees it (read in process here).
        for name, e in self.engines:
            st = e.runner.engine.stats()
            self.router.report_load(name, waiting=int(st["num_waiting"]), running=int(st["num_running"]),
                                    kv_usage=float(st["kv_usage"]))
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


def emulated_run(wl: Any, spec: Any, fleet_params: Any, time_scale: float) -> dict[str, Any]:
    """Run workload `wl` through emulated engines configured as the simulator's fleet
    (FleetParams.engine_config), a kvroute Router made as the simulator makes it
    (sim.make_router) behind a RouterProxy, and kvroute.bench's client replaying the
    workload's own timing x time_scale. Times are returned in engine seconds."""
    import dataclasses
    import math
    import time

    import numpy as np
    from emulate_util import free_ports, start_fleet

    from kvroute import sim
    from kvroute.bench.client import BenchConfig, run
    from kvroute.bench.report import summarize

    n = fleet_params.replicas
    engine = dataclasses.asdict(fleet_params.engine_config(wl.block_tokens))
    ft = start_fleet(n, time_scale=time_scale, engine=engine)
    try:
        router = sim.make_router(spec.config(), fleet_params, wl.block_tokens)
        names = [f"replica-{i}" for i in range(n)]
        engines = ft.fleet.engines
        proxy = RouterProxy(router, engines, names, sessions=spec.sessions, clock=engines[0].runner.now)
        port = free_ports(1)[0]
        asyncio.run_coroutine_threadsafe(proxy.start(port), ft.loop).result(30)
        started = time.perf_counter()
        try:
            results, wall = asyncio.run(run(BenchConfig(url=f"http://127.0.0.1:{port}", time_scale=time_scale,
                                                        timeout=120.0), wl))
        finally:
            asyncio.run_coroutine_threadsafe(proxy.stop(), ft.loop).result(30)
        elapsed = time.perf_counter() - started
        counters = ft.call(lambda: [e.runner.counters.ttft for e in engines])
    finally:
        ft.stop()
    s = summarize(spec.name, results, wall)
    ttft = np.array([r.ttft for r in results if r.error is None], dtype=np.float64) / time_scale
    return {"hit_rate": s.hit_rate, "ttft_p50": float(np.percentile(ttft, 50)) if ttft.size else math.nan,
            "ttft_mean": float(ttft.mean()) if ttft.size else math.nan,
            "ttft_p90": float(np.percentile(ttft, 90)) if ttft.size else math.nan,
            "engine_ttft_mean": sum(h.total for h in counters) / max(1, sum(h.n for h in counters)),
            "requests": s.requests, "errors": s.errors, "wall_s": elapsed}


def agreement_workload() -> Any:
    """tests/test_emulate_agreement.py's workload: SGLang's generated shared prefix, 8
    groups x 8 prompts of 1,024 + 1,024 tokens, 32 output tokens, Poisson 6 requests/s."""
    from kvroute import sim

    return sim.shared_prefix(sim.SharedPrefixParams(groups=8, prompts_per_group=8, system_tokens=1024,
                                                    question_tokens=1024, output_tokens=32, rate=6.0), seed=1)
