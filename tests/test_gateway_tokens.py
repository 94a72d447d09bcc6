"""The gateway's token ids agree with the engine's: with the same Hugging Face tokenizer
(`--tokenizer PATH`) and with the engine's own /tokenize (`--tokenizer engine`), the cached
tokens the router predicts are the cached tokens the emulated engine reports."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from kvroute.emulate import EmulatorOptions, EnginePorts, FleetThread  # noqa: E402
from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from tests.gateway_harness import GatewayThread, free_port, get_json, openai_client, wait_until  # noqa: E402
from tests.tokenizers_fixture import train_folder  # noqa: E402

MODEL = "kvroute-emulated"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return train_folder(str(tmp_path_factory.mktemp("tok")), "llama3")


@pytest.mark.parametrize("mode", ["path", "engine"])
def test_predicted_equals_engine_cached(folder, tmp_path, mode):
    ports = [EnginePorts(free_port(), free_port(), free_port()) for _ in range(2)]
    fleet = FleetThread(ports, EmulatorOptions(time_scale=0.02, tokenizer=folder)).start()
    log = tmp_path / "d.jsonl"
    gw = None
    try:
        specs = tuple(ReplicaSpec.parse(f"{e.serve_args()},name=e{e.index}") for e in fleet.fleet.engines)
        gw = GatewayThread(GatewayConfig(replicas=specs, port=free_port(), decision_log=str(log),
                                         tokenizer=folder if mode == "path" else "engine")).start()
        c = openai_client(gw)
        history = [{"role": "system", "content": "the quick brown fox jumps over the lazy dog " * 10}]
        reported = []
        for turn in range(3):
            history.append({"role": "user", "content": f"hello world, question {turn}?"})
            r = c.chat.completions.create(model=MODEL, messages=history, max_tokens=8,
                                          extra_headers={"X-Session-ID": "s1"})
            reported.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            name = json.loads(log.read_text().splitlines()[-1])["replica"]
            # wait until the engine's events for this turn reached the index before the next
            need = (r.usage.prompt_tokens + r.usage.completion_tokens - 1) // 16
            assert wait_until(lambda: {x["name"]: x for x in get_json(gw.url + "/kvroute/replicas")["replicas"]}
                              [name]["blocks_held"] >= need, 10)
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [(d["prompt_tokens"], d["cached_tokens"]) for d in lines] == reported
        assert reported[-1][1] > 0
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
