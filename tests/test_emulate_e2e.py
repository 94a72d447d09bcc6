"""`kvroute emulate` end to end on loopback: four emulated engines in a thread, driven by
the official `openai` client, aiohttp and kvroute's own Subscriber.

- completions and chat completions, streamed and not, report usage with
  prompt_tokens_details.cached_tokens, and a repeated prompt hits the engine's cache;
- kvroute's Subscriber, following the engines' KV events over ZMQ, ends with exactly the
  blocks each engine's cache holds (replayed from the events the engine emitted);
- /metrics parses with prometheus_client's parser and carries vLLM's names;
- bad requests get 400 (404 for an unknown model) with the OpenAI error object naming
  the field; a client that disconnects aborts its engine request.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("zmq")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prom_parser = pytest.importorskip("prometheus_client.parser")

from emulate_util import WAIT, cache_content, eventually, kvroute_hashes, start_fleet  # noqa: E402

import kvroute  # noqa: E402
from kvroute.events import EventApplier, Source, Subscriber  # noqa: E402
from tests.gateway_harness import openai_client  # noqa: E402

N = 4
MODEL = "emu-test"
KV_BLOCKS = 32  # small, so that the traffic below evicts


@pytest.fixture(scope="module")
def fleet():
    ft = start_fleet(N, model=MODEL, time_scale=0.02, engine={"block_size": 16, "num_kv_blocks": KV_BLOCKS})
    yield ft
    ft.stop()


def client(fleet, i=0):
    return openai_client(fleet.fleet.engines[i].url)


def metrics(fleet, i):
    text = httpx.get(fleet.fleet.engines[i].url + "/metrics").text
    out = {}
    for fam in prom_parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))))] = s.value
    return out


def test_completions_report_usage_and_cached_tokens(fleet):
    c = client(fleet, 1)
    prompt = list(range(1000, 1000 + 100))
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert first.choices[0].finish_reason == "length" and first.choices[0].text
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (100, 5)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < 100 and cached % 16 == 0
    text = c.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
    assert text.usage.prompt_tokens == len("hello world") and text.usage.completion_tokens == 3


def test_streamed_completion_ends_with_usage_and_done(fleet):
    c = client(fleet, 2)
    chunks = list(c.completions.create(model=MODEL, prompt=list(range(50)), max_tokens=7, stream=True,
                                       stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) >= 1 and all(texts)
    assert chunks[-2].choices[0].finish_reason == "length" if len(chunks) > 1 else True
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    # The raw stream ends with [DONE]; without include_usage no usage chunk is sent.
    raw = httpx.post(fleet.fleet.engines[2].url + "/v1/completions",
                     json={"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}).text
    events = [line for line in raw.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all('"usage"' not in e for e in events)


def test_chat_streamed_and_not(fleet):
    c = client(fleet, 3)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 4
    tokenized = httpx.post(fleet.fleet.engines[3].url + "/tokenize", json={"messages": messages}).json()
    assert tokenized["count"] == full.usage.prompt_tokens == len(tokenized["tokens"])
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == "stop"  # no max_tokens: the answer ends by itself
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same conversation as before


def test_models_health_tokenize(fleet):
    url = fleet.fleet.engines[0].url
    assert httpx.get(url + "/health").status_code == 200
    models = client(fleet).models.list()
    assert [m.id for m in models.data] == [MODEL]
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "abc"}).json()
    assert tok["count"] == 3 and tok["max_model_len"] > 0


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": [1], "n": 2}, "n"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": [7] * 200_000}, "prompt"),
    ("/v1/completions", {"prompt": [7] * 400, "max_tokens": 200}, "max_tokens"),  # more than the KV memory
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/tokenize", {"prompt": 3}, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(fleet, path, body, field):
    r = httpx.post(fleet.fleet.engines[0].url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split("_")[0] in err["message"] and err["type"] == "BadRequestError"


def test_malformed_json_unknown_model_and_routes(fleet):
    url = fleet.fleet.engines[0].url
    r = httpx.post(url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "object" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client(fleet).completions.create(model="other", prompt=[1], max_tokens=1)
    assert httpx.get(url + "/nope").status_code == 404
    assert httpx.get(url + "/v1/completions").status_code == 405


def test_disconnect_aborts_the_engine_request():
    """Real time and a long answer: the client leaves after the first chunk, or before
    the non-streamed answer is complete."""
    ft = start_fleet(1, time_scale=1.0)
    try:
        url = ft.fleet.engines[0].url
        key = ("vllm:request_success_total", (("finished_reason", "abort"),))
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": list(range(40)), "max_tokens": 10_000, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        eventually(lambda: metrics(ft, 0)[key] == 1, "the abort")
        eventually(lambda: metrics(ft, 0)[("vllm:num_requests_running", ())] == 0, "the engine to drain")
        assert ft.call(lambda: ft.fleet.engines[0].runner.engine.stats()["aborted"]) == 1
        # Not streamed: the client gives up waiting for the whole answer.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 10_000}, timeout=0.5)
        eventually(lambda: metrics(ft, 0)[key] == 2, "the second abort")
        eventually(lambda: metrics(ft, 0)[("vllm:num_requests_running", ())] == 0, "the engine to drain")
    finally:
        ft.stop()


def test_metrics_parse_with_vllm_names(fleet):
    m = metrics(fleet, 1)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:generation_tokens_total"):
        assert (name, ()) in m, name
    assert m[("vllm:prefix_cache_hits_total", ())] <= m[("vllm:prefix_cache_queries_total", ())]
    assert m[("vllm:time_to_first_token_seconds_count", ())] >= 3  # test_completions... ran on engine 1
    assert 0.0 <= m[("vllm:kv_cache_usage_perc", ())] <= 1.0
    assert m[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == \
        m[("vllm:time_to_first_token_seconds_count", ())]


def test_subscriber_ends_with_exactly_the_engines_blocks(fleet):
    """Traffic with shared prefixes and evictions on all four engines; kvroute's Subscriber
    (joining late: the first batches come from the replay socket) must hold per engine
    exactly the blocks the engine's cache holds (Engine.cached_hashes)."""
    engines = fleet.fleet.engines
    rng = random.Random(5)
    prefixes = [[rng.randrange(5000, 6000) for _ in range(64)] for _ in range(6)]
    index = kvroute.PrefixIndex(N)
    applier = EventApplier(index, 16)
    sources = [Source(i, e.events_endpoint, replay_endpoint=e.replay_endpoint) for i, e in enumerate(engines)]

    def traffic(count):
        for k in range(count):
            e = engines[k % N]
            prompt = rng.choice(prefixes) + [rng.randrange(6000, 7000) for _ in range(rng.randrange(1, 100))]
            r = httpx.post(e.url + "/v1/completions", json={"prompt": prompt, "max_tokens": rng.randrange(1, 40)},
                           timeout=WAIT)
            assert r.status_code == 200, r.text

    traffic(8)  # published before the subscriber joins: it must replay them
    with Subscriber(applier, sources) as sub:
        traffic(56)
        for i, e in enumerate(engines):
            eventually(lambda: fleet.call(lambda: not e.runner.engine.has_work()), "the engine to go idle")
            last = fleet.call(lambda: e.publisher.seq) - 1
            assert sub.wait_for_seq(i, last, WAIT)
        status = sub.status()
    assert status["malformed"] == 0 and status["resyncs"] == 0
    assert status["replays"] >= N  # every engine published before the subscriber joined
    removed = 0
    for i, e in enumerate(engines):
        events = fleet.call(lambda: list(fleet.published[i]))
        removed += sum(type(ev).__name__ == "BlockRemoved" for ev in events)
        kv = kvroute_hashes(events)
        cached = fleet.call(lambda: e.runner.engine.cached_hashes())
        assert cache_content(events) == {h: n for h, n in cached.items() if n}  # the events tell the truth
        truth = sorted({kv[h] for h in cached})
        assert sorted(int(h) for h in index.held(i)) == truth, f"engine {i}"
    assert removed > 0  # the cache was small enough to evict


def test_json_bodies_are_not_tracebacks(fleet):
    r = httpx.post(fleet.fleet.engines[0].url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and "Traceback" not in r.text
    json.loads(r.text)


def test_hugging_face_tokenizer_and_chat_template(tmp_path):
    """--tokenizer PATH: prompts, /tokenize and chat go through the HF tokenizer and its
    template, and agree with kvroute.tokenize's own encoding."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers_fixture import train_folder

    from kvroute.tokenize import load_tokenizer

    folder = train_folder(str(tmp_path / "tok"), "chatml")
    tok = load_tokenizer(folder)
    ft = start_fleet(1, time_scale=0.02, tokenizer=folder)
    try:
        url = ft.fleet.engines[0].url
        messages = [{"role": "user", "content": "hello world, how are you today?"}]
        r = httpx.post(url + "/tokenize", json={"messages": messages}).json()
        assert r["tokens"] == tok.encode_chat(messages)
        r = httpx.post(url + "/tokenize", json={"prompt": "the quick brown fox"}).json()
        assert r["tokens"] == tok.encode("the quick brown fox", add_special_tokens=True)
        c = openai_client(url)
        chat = c.chat.completions.create(model="kvroute-emulated", messages=messages, max_tokens=2)
        assert chat.usage.prompt_tokens == len(tok.encode_chat(messages))
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        ft.stop()


def test_a_chat_answer_sent_back_hits_its_own_blocks(fleet):
    """The answer is the same token sequence the engine cached (the filler, re-tokenized by
    the chat template), so the next turn's cached tokens reach past the first prompt."""
    c = client(fleet, 2)
    first = [{"role": "user", "content": "tell me about prefix caches " * 4}]
    r1 = c.chat.completions.create(model=MODEL, messages=first, max_tokens=48)
    p1 = r1.usage.prompt_tokens
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "and then?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=second, max_tokens=2)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= (p1 + 32) // 16 * 16 > p1 // 16 * 16, (p1, cached)
