"""`kvroute serve` under faults and with exact bytes, on loopback with the official openai
client against tests/fake_engine.py processes (killable, deterministic answers, injected
5xx), the gateway in a thread, everything on free ports."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("aiohttp")
import openai  # noqa: E402

from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from tests.gateway_harness import Engine, GatewayThread, free_port, metrics_of, wait_until  # noqa: E402
from tests.gateway_harness import openai_client as client  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def engines():
    es = [Engine(f"e{i}", chunks=4, gap=0.01).start() for i in range(4)]
    try:
        for e in es:
            e.wait()
        yield es
    finally:
        for e in es:
            e.kill()


def gateway_for(engines, **kw) -> GatewayThread:
    specs = tuple(ReplicaSpec(e.url, name=e.name) for e in engines)
    cfg = GatewayConfig(replicas=specs, port=free_port(), health_interval=0.1, scrape_interval=0.1,
                        breaker_backoff=0.2, breaker_max_backoff=0.4, **kw)
    return GatewayThread(cfg).start()


@pytest.fixture(scope="module")
def gateway(engines):
    gw = gateway_for(engines)
    yield gw
    gw.stop()




def test_body_and_bytes_unchanged(gateway, engines):
    """The engine's answer comes back byte for byte (compare with the engine direct)."""
    import urllib.request

    body = b'{"model":"fake-model","prompt":"x","stream":true,"stream_options":{"include_usage":true}}'

    def raw(url):
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return r.read(), dict(r.headers)

    via, headers = raw(gateway.url)
    direct, _ = raw(engines[0].url)
    assert via == direct and headers["x-kvroute-replica"] in {e.name for e in engines}


def test_replica_killed_mid_run(engines):
    """One engine dies while requests flow: every request succeeds (those that hit it before
    any byte are retried elsewhere), its breaker opens, and closes once it is back."""
    es = [Engine(f"k{i}", chunks=2, gap=0.01, ttft=0.2).start() for i in range(3)]
    for e in es:
        e.wait()
    gw = gateway_for(es)
    victim = es[0]
    try:
        errors: list[BaseException] = []
        done = []
        busy: list[int] = []

        async def one(c, i):
            try:
                r = await c.chat.completions.create(model="fake-model", messages=MESSAGES + [
                    {"role": "user", "content": f"q{i}"}])
                done.append(r.choices[0].message.content)
            except BaseException as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        async def run():
            c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
            tasks = []
            for i in range(60):
                tasks.append(asyncio.ensure_future(one(c, i)))
                if i == 20:
                    busy.append(victim.stats()["in_flight"])  # requests before their first byte
                    await asyncio.get_running_loop().run_in_executor(None, victim.kill)
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
            await c.close()

        asyncio.run(run())
        assert not errors and len(done) == 60
        m = metrics_of(gw)
        assert m["kvroute_breaker_opened_total"][(("replica", "k0"),)] >= 1
        assert busy[0] >= 1 and m["kvroute_retries_total"][(("replica", "k0"),)] >= busy[0]
        assert gw.app.fleet.get("k0").breaker.state != "closed"
        victim.start().wait()
        assert wait_until(lambda: gw.app.fleet.get("k0").breaker.state == "closed", 10)
        assert metrics_of(gw)["kvroute_breaker_state"][(("replica", "k0"),)] == 0
    finally:
        gw.stop()
        for e in es:
            e.kill()


def test_retry_on_5xx_before_first_byte(engines):
    bad = Engine("bad", fail_status=503).start().wait()
    gw = gateway_for([bad, engines[0]], policy="round_robin")
    try:
        c = client(gw)
        for _ in range(4):
            raw = c.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
            assert raw.headers["x-kvroute-replica"] == "e0"
        m = metrics_of(gw)
        assert m["kvroute_retries_total"][(("replica", "bad"),)] >= 1
        assert bad.stats()["requests"] >= 1
    finally:
        gw.stop()
        bad.kill()


def test_graceful_shutdown_drains(engines):
    slow = Engine("drain", chunks=10, gap=0.05).start().wait()
    gw = gateway_for([slow])
    try:
        c = client(gw, timeout=30)
        stream = c.completions.create(model="fake-model", prompt="x", stream=True)
        it = iter(stream)
        texts = [next(it).choices[0].text]
        stopper = threading.Thread(target=gw.stop)
        stopper.start()  # what SIGTERM does: stop accepting, let requests in flight finish
        assert wait_until(lambda: not _accepts(gw.config.port), 5)
        texts += [ch.choices[0].text for ch in it]
        stopper.join(30)
        assert "".join(texts) == "".join(f"w{i} " for i in range(10))
        assert slow.stats()["completed"] == 1 and slow.stats()["aborted"] == 0
        assert not gw.thread.is_alive() and gw.app.http is None  # lifespan shutdown closed the pool
    finally:
        gw.stop()
        slow.kill()


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_cache_keys_separate_lora_and_salt(engines, tmp_path):
    """LoRA adapters (learned from /v1/models) and cache_salt give distinct chains: a prompt
    routed before matches itself, not the same prompt under another adapter or salt."""
    import json

    log = tmp_path / "decisions.jsonl"
    gw = gateway_for(engines[:1], decision_log=str(log))
    try:
        assert wait_until(lambda: "fake-lora" in gw.app.fleet.lora_models, 5)
        c = client(gw)
        long = [{"role": "user", "content": "a question long enough to fill several blocks " * 4}]
        for kw in ({}, {}, {"model": "fake-lora"}, {"extra_body": {"cache_salt": "tenant"}}):
            c.chat.completions.create(messages=long, **{"model": "fake-model", **kw})
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [x["cached_tokens"] > 0 for x in lines] == [False, True, False, False]
        assert lines[2]["lora"] == "fake-lora" and lines[0]["lora"] is None
    finally:
        gw.stop()


def test_client_gone_before_first_byte():
    """A client that leaves while the engine has not answered yet: the engine's request is
    aborted and the router's load released."""
    slow = Engine("ttft", ttft=30).start().wait()
    gw = gateway_for([slow])
    try:
        c = client(gw, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            c.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert wait_until(lambda: slow.stats()["aborted"] == 1, 10)
        assert wait_until(lambda: gw.app.router.load("ttft")["in_flight"] == 0, 10)
        assert gw.app.fleet.get("ttft").in_flight == 0
    finally:
        gw.stop()
        slow.kill()
