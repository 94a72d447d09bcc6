"""`kvroute serve` end to end on loopback with the official openai client and four emulated
engines (kvroute.emulate, in a thread): chat and completions, streamed and not, sessions,
precise mode on the engines' KV events, metrics, admin API, client disconnects."""

from __future__ import annotations

import json
import pytest

pytest.importorskip("aiohttp")

from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from kvroute.tokenize import load_tokenizer  # noqa: E402
from tests.gateway_harness import GatewayThread, call, emulated_fleet, free_port, get_json, metrics_of, wait_until  # noqa: E402
from tests.gateway_harness import openai_client as client  # noqa: E402

MODEL = "kvroute-emulated"
DOC = "The gateway routes each prompt to the replica that holds its leading KV blocks. " * 12


@pytest.fixture(scope="module")
def fleet():
    yield from emulated_fleet(4)


@pytest.fixture(scope="module")
def gateway(fleet, tmp_path_factory):
    specs = tuple(ReplicaSpec.parse(f"{e.serve_args()},name=e{e.index}") for e in fleet.fleet.engines)
    log = tmp_path_factory.mktemp("gw") / "decisions.jsonl"
    gw = GatewayThread(GatewayConfig(replicas=specs, port=free_port(), scrape_interval=0.1, health_interval=0.2,
                                     decision_log=str(log))).start()
    gw.log = log
    yield gw
    gw.stop()



def decisions(gw) -> list[dict]:
    return [json.loads(x) for x in gw.log.read_text().splitlines()]



def test_precise_mode_is_the_default_and_follows_events(gateway):
    reps = get_json(gateway.url + "/kvroute/replicas")
    assert reps["mode"] == "precise" and all(r["knowledge"] == "events" for r in reps["replicas"])
    c = client(gateway)
    msgs = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarize."}]
    first = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=4)
    name = first.headers["x-kvroute-replica"]
    blocks = len(load_tokenizer(None).encode_chat(msgs)) // 16
    # the engine's BlockStored events reach the gateway's index
    assert wait_until(lambda: {r["name"]: r for r in get_json(gateway.url + "/kvroute/replicas")["replicas"]}
                      [name]["blocks_held"] >= blocks, 10)
    again = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=4)
    assert again.headers["x-kvroute-replica"] == name
    last = decisions(gateway)[-1]
    assert last["reason"] == "affinity" and last["cached_tokens"] == blocks * 16
    assert again.parse().usage.prompt_tokens_details.cached_tokens == blocks * 16  # the engine agrees


def test_chat_and_completions_streamed_and_not(gateway):
    c = client(gateway)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    t = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert t.usage.completion_tokens == 3 and t.usage.prompt_tokens == len("Once upon a time")
    streamed = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=list(range(40, 80)),
                                                                  max_tokens=3, stream=True) if ch.choices]
    assert len("".join(streamed)) > 0
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_sessions_stay_put(gateway):
    c = client(gateway)
    seen: dict[str, set[str]] = {}
    for turn in range(3):
        for s in ("alice", "bob", "carol", "dave"):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"{s} asks question {turn}"}],
                extra_headers={"X-Session-ID": s})
            seen.setdefault(s, set()).add(raw.headers["x-kvroute-replica"])
    by_user = {c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=1, user="erin")
               .headers["x-kvroute-replica"] for i in range(3)}
    assert all(len(v) == 1 for v in seen.values()) and len(by_user) == 1


def test_metrics_parse(gateway):
    c = client(gateway)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": DOC}], max_tokens=2)
    m = metrics_of(gateway)
    assert sum(m["kvroute_requests_total"].values()) >= 1
    assert {dict(k)["stage"] for k in m["kvroute_decision_seconds_count"]} == {"tokenize", "hash", "score"}
    assert sum(m["kvroute_reported_usage_requests_total"].values()) >= 1
    assert set(dict(k)["replica"] for k in m["kvroute_events_batches_total"]) == {"e0", "e1", "e2", "e3"}
    assert "kvroute_events_lag_seconds" in m and "kvroute_breaker_state" in m
    ratios = m.get("kvroute_cache_calibration_ratio", {})
    assert all(v >= 0 for v in ratios.values())
    # the engines' scraped load reaches the router
    assert wait_until(lambda: all(r["load"]["running"] is not None
                                  for r in get_json(gateway.url + "/kvroute/replicas")["replicas"]), 5)


def test_client_disconnect_cancels_upstream(gateway, fleet):
    c = client(gateway, timeout=30)
    stream = c.completions.create(model=MODEL, prompt="a long story", max_tokens=100_000, stream=True)
    first = next(iter(stream))
    assert first.choices
    engines = {f"e{e.index}": e for e in fleet.fleet.engines}
    busy = [n for n, e in engines.items() if fleet.call(lambda e=e: len(e.runner.streams)) == 1]
    assert len(busy) == 1
    name = busy[0]
    before = fleet.call(lambda: engines[name].runner.counters.aborted)
    assert gateway.app.router.load(name)["in_flight"] == 1
    stream.close()
    assert wait_until(lambda: fleet.call(lambda: engines[name].runner.counters.aborted) == before + 1, 10)
    assert wait_until(lambda: gateway.app.router.load(name)["in_flight"] == 0, 10)
    assert fleet.call(lambda: len(engines[name].runner.streams)) == 0
    assert wait_until(lambda: sum(metrics_of(gateway)["kvroute_client_disconnects_total"].values()) == 1, 5)


def test_admin_drain_remove_add(gateway, fleet):
    url = gateway.url + "/kvroute/replicas"
    c = client(gateway)
    e0 = fleet.fleet.engines[0]
    for name in ("e1", "e2", "e3"):
        assert call("POST", f"{url}/{name}/drain")[0] == 200
    for i in range(4):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"drained {i}", max_tokens=1)
        assert raw.headers["x-kvroute-replica"] == "e0"
    status, obj = call("POST", f"{url}/e1/drain", {"draining": False})
    assert status == 200 and obj["draining"] is False
    assert call("DELETE", f"{url}/e0")[0] == 200 and call("DELETE", f"{url}/e0")[0] == 404
    assert {r["name"] for r in get_json(url)["replicas"]} == {"e1", "e2", "e3"}
    for i in range(4):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"removed {i}", max_tokens=1)
        assert raw.headers["x-kvroute-replica"] == "e1"
    status, obj = call("POST", url, {"url": e0.url, "name": "e0", "events": e0.events_endpoint,
                                     "replay": e0.replay_endpoint})
    assert status == 201 and obj["knowledge"] == "events" and obj["health"] == "closed"
    assert call("POST", url, {"url": e0.url, "name": "e0"})[0] == 409
    status, obj = call("POST", url, {"url": "ftp://x", "name": "z"})
    assert status == 400 and obj["error"]["param"] == "url"
    for name in ("e2", "e3"):
        call("POST", f"{url}/{name}/drain", {"draining": False})


def test_bad_requests_name_the_field(gateway):
    for body, field in (({"model": MODEL}, "messages"), ({"messages": [{"content": "x"}]}, "messages[0]"),
                        ({"messages": [{"role": "user", "content": "x"}], "cache_salt": 3}, "cache_salt")):
        status, obj = call("POST", gateway.url + "/v1/chat/completions", body)
        assert status == 400 and obj["error"]["param"] == field, obj
    status, obj = call("POST", gateway.url + "/v1/completions", {"prompt": [1, -2]})
    assert status == 400 and obj["error"]["param"] == "prompt"
    assert call("GET", gateway.url + "/nope")[0] == 404
