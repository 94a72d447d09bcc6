"""GET /kvroute/diagnostics on a live gateway: fed by the requests it routed."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from tests.gateway_harness import Engine, GatewayThread, free_port, get_json, openai_client  # noqa: E402

SYSTEM = "You are a careful assistant. " * 40  # ~1,100 byte tokens the prompts share


def test_diagnostics_endpoint_finds_a_volatile_header():
    engines = [Engine(f"d{i}", chunks=2, gap=0.0).start() for i in range(2)]
    gw = None
    try:
        for e in engines:
            e.wait()
        cfg = GatewayConfig(replicas=tuple(ReplicaSpec(e.url, name=e.name) for e in engines), port=free_port(),
                            health_interval=0.1, scrape_interval=0.1)
        gw = GatewayThread(cfg).start()
        c = openai_client(gw)
        for i in range(16):
            # A request id at the top of the system prompt: the rest repeats, the cache cannot see it.
            stamp = f"request {time.monotonic_ns() % 10**9:09d}\n"
            c.chat.completions.create(model="fake-model", messages=[
                {"role": "system", "content": stamp + SYSTEM}, {"role": "user", "content": f"question {i}"}])
        d = get_json(gw.url + "/kvroute/diagnostics")
        assert sorted(r["replica"] for r in d["replicas"]) == ["d0", "d1"]
        assert sum(r["requests"] for r in d["replicas"]) == 16 and d["pooled"]["lookups"] == 16
        assert d["ttft"]["cold"]["samples"] + d["ttft"]["warm"]["samples"] == 16
        vol = d["volatile"]  # one request in 4 is read: 4 prompts, the last 3 repeat the first
        assert vol["sampled_every"] == 4 and vol["prompts"] == 4
        assert vol["found"] and vol["affected_prompts"] == 3 and vol["lost_tokens"] > 3 * 1000
        assert all(o["offset"] < 40 for o in vol["divergence_offsets"])
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.kill()
