"""Precise mode: the gateway follows a replica's KV events (a ZMQ publisher in the test speaking
vLLM's wire form) and routes a prompt to the replica whose events say it holds its blocks; a
replica without events= is recorded at route time."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("openai")

from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from kvroute.tokenize import load_tokenizer  # noqa: E402
from tests import kv_wire  # noqa: E402
from tests.gateway_harness import Engine, GatewayThread, call, free_port, get_json, openai_client, wait_until  # noqa: E402

MESSAGES = [{"role": "system", "content": "You answer questions about the long document below. " * 8},
            {"role": "user", "content": "What is it about?"}]


def test_precise_mode_follows_events():
    engines = [Engine(f"p{i}").start() for i in range(2)]
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    gw = None
    try:
        for e in engines:
            e.wait()
        specs = (ReplicaSpec(engines[0].url, name="p0"),
                 ReplicaSpec(engines[1].url, name="p1", events=f"tcp://127.0.0.1:{port}"))
        gw = GatewayThread(GatewayConfig(replicas=specs, port=free_port(), mode="precise")).start()
        url = gw.url + "/kvroute/replicas"
        tokens = load_tokenizer(None).encode_chat(MESSAGES)
        full = len(tokens) // 16 * 16
        blocks = [tokens[i:i + 16] for i in range(0, full, 16)]
        seq = 0

        def publish() -> bool:
            nonlocal seq
            events = [kv_wire.stored("vllm-map", [1000 + i], 1000 + i - 1 if i else None, b, 16)
                      for i, b in enumerate(blocks)]
            pub.send_multipart([b"", seq.to_bytes(8, "big"), kv_wire.batch(events)])
            seq += 1
            rep = {r["name"]: r for r in get_json(url)["replicas"]}["p1"]
            return rep["blocks_held"] == len(blocks)

        assert wait_until(publish, 10, 0.1)  # the subscriber joins a little after the gateway starts
        c = openai_client(gw)
        raw = c.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
        assert raw.headers["x-kvroute-replica"] == "p1"
        reps = {r["name"]: r for r in get_json(url)["replicas"]}
        assert reps["p1"]["knowledge"] == "events" and reps["p1"]["events_status"]["batches"] >= 1
        assert reps["p0"]["knowledge"] == "routes" and reps["p0"]["blocks_held"] == 0
        # p1's index is fed by events only: routing there recorded nothing new
        assert reps["p1"]["blocks_held"] == len(blocks)
        # a replica without events is recorded at route time
        assert call("POST", url + "/p1/drain")[0] == 200
        other = [{"role": "user", "content": "A different question, long enough to fill some blocks." * 4}]
        raw = c.chat.completions.with_raw_response.create(model="fake-model", messages=other)
        assert raw.headers["x-kvroute-replica"] == "p0"
        assert get_json(url)["replicas"][0]["blocks_held"] > 0
        import urllib.request

        text = urllib.request.urlopen(gw.url + "/metrics").read().decode()
        assert 'kvroute_events_batches_total{replica="p1"}' in text
        assert 'kvroute_events_lag_seconds{replica="p1"}' in text
    finally:
        if gw is not None:
            gw.stop()
        pub.close(0)
        for e in engines:
            e.kill()
