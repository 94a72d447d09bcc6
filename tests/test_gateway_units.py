"""The gateway's pure parts: config (TOML + flags), breaker (a state machine against a naive
model), engine /metrics parsing, request bodies to prompts and keys."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvroute.gateway.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from kvroute.gateway.config import GatewayConfig, ReplicaSpec, parse_argv
from kvroute.gateway.load import parse_load, parse_models
from kvroute.gateway.prompt import BadRequest, LocalTokens, build_prompt, completion_prompt, keys, session_of
from kvroute.tokenize import load_tokenizer


def test_replica_spec_parse():
    r = ReplicaSpec.parse("http://127.0.0.1:8001/,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,block_size=32")
    assert (r.url, r.name, r.events, r.replay, r.block_size) == (
        "http://127.0.0.1:8001", "127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 32)
    assert ReplicaSpec.parse("http://h:1,name=a").name == "a"
    for bad, msg in (("ftp://h", "url"), ("http://h:1,foo=1", "unknown option"), ("http://h:1,events=nope", "events"),
                     ("http://h:1,replay=tcp://x:1", "replay= needs events="), ("http://h:1,block_size=0", "block_size")):
        with pytest.raises(ValueError, match=msg):
            ReplicaSpec.parse(bad)


def test_toml_then_flags(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('port = 9100\npolicy = "sglang"\nsession_header = "X-User"\nlora_models = ["a", "b"]\n'
                    'policy_params = { balance_abs = 8 }\n'
                    '[[replica]]\nurl = "http://127.0.0.1:8001"\nname = "r0"\n'
                    '[[replica]]\nurl = "http://127.0.0.1:8002"\nevents = "tcp://127.0.0.1:5557"\n')
    cfg = parse_argv(["--config", str(path)])
    assert (cfg.port, cfg.policy, cfg.session_header, cfg.lora_models) == (9100, "sglang", "X-User", ("a", "b"))
    assert [r.name for r in cfg.replicas] == ["r0", "127.0.0.1:8002"] and cfg.routing_mode == "approximate"
    cfg = parse_argv(["--config", str(path), "--port", "9200", "--replica", "http://127.0.0.1:9,events=tcp://x:1",
                      "--lora-models", "z"])
    assert cfg.port == 9200 and [r.url for r in cfg.replicas] == ["http://127.0.0.1:9"]
    assert cfg.routing_mode == "precise" and cfg.lora_models == ("z",) and cfg.policy == "sglang"
    path.write_text("colour = 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_argv(["--config", str(path)])
    with pytest.raises(ValueError, match="unique"):
        GatewayConfig(replicas=(ReplicaSpec("http://a:1"), ReplicaSpec("http://a:1")))
    with pytest.raises(ValueError, match="policy"):
        GatewayConfig(policy="best")


def test_every_flag_has_a_toml_key():
    import argparse

    from kvroute.gateway.config import _FIELDS, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    dests = {a.dest for a in p._actions} - {"help", "config"}
    assert {("replicas" if d == "replica" else d) for d in dests} <= set(_FIELDS)
    assert set(_FIELDS) - {"replicas"} - {"policy_params"} <= dests


class BreakerMachine(RuleBasedStateMachine):
    """Breaker against a naive model: a list of the open periods so far."""

    def __init__(self) -> None:
        super().__init__()
        self.b = Breaker(backoff=1.0, max_backoff=8.0)
        self.now = 0.0
        self.state, self.until, self.period = CLOSED, 0.0, 0.0

    @rule(dt=st.floats(0, 20))
    def tick(self, dt):
        self.now += dt

    @rule()
    def fail(self):
        opened = self.b.failure(self.now)
        if self.state == OPEN:
            assert not opened
            return
        self.period = 1.0 if self.state == CLOSED else min(self.period * 2, 8.0)
        self.state, self.until = OPEN, self.now + self.period
        assert opened

    @rule()
    def succeed(self):
        closed = self.b.success()
        assert closed == (self.state == HALF_OPEN)
        if closed:
            self.state = CLOSED

    @rule()
    def probe(self):
        if self.state == OPEN and self.now >= self.until:
            self.state = HALF_OPEN
        assert self.b.probe_due(self.now) == (self.state != OPEN)

    @invariant()
    def agrees(self):
        assert self.b.state == self.state and self.b.routable == (self.state == CLOSED)
        if self.state != CLOSED:
            assert self.b.period == self.period and 1.0 <= self.b.period <= 8.0


TestBreaker = BreakerMachine.TestCase


def test_parse_load_vllm_and_sglang():
    text = ("# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_running{model_name="m"} 7\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:num_requests_swapped{model_name="m"} 9\n')
    assert parse_load(text) == {"waiting": 5, "running": 7, "kv_usage": 0.25}
    sg = 'sglang:num_queue_reqs{name="x"} 4\nsglang:num_running_reqs 1\nsglang:token_usage 1.5\nsglang:token_usage NaN\n'
    assert parse_load(sg) == {"waiting": 4, "running": 1, "kv_usage": 1.0}
    assert parse_load("other 1\n") == {}
    models, lora = parse_models({"data": [{"id": "base"}, {"id": "ad", "parent": "base"}, {"x": 1}]})
    assert [m["id"] for m in models] == ["base", "ad"] and lora == {"ad"}
    assert parse_models([]) == ([], set())


def test_prompts_and_keys():
    tok = load_tokenizer(None)
    lt = LocalTokens(tok, 8)
    body = {"model": "ad", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}],
        "cache_salt": "tenant-1", "user": "u1"}
    ids = lt.chat(body, "s")
    assert ids.tolist() == tok.encode_chat([{"role": "user", "content": "look"}])
    p = build_prompt(body, "chat", ids, session_of(body, None), frozenset({"ad"}))
    assert (p.lora, p.cache_salt, p.session, p.stream) == ("ad", "tenant-1", "u1", False)
    assert p.mm is not None and len(p.mm) == 1
    assert keys({"model": "base"}, frozenset({"ad"})) == (None, None)
    assert session_of({"user": "u"}, "hdr") == "hdr"
    assert lt.completion({"prompt": [5, 6]}) == [5, 6] and lt.completion({"prompt": ["ab", "cd"]}) == [97, 98]
    assert completion_prompt({"prompt": [[1, 2], [3]]}) == [1, 2]
    for bad, field in (({"prompt": True}, "prompt"), ({"prompt": []}, "prompt")):
        with pytest.raises(BadRequest) as e:
            lt.completion(bad)
        assert e.value.param == field
    with pytest.raises(BadRequest) as e:
        lt.chat({"messages": [{"role": "user", "content": "x"}], "tools": "no"}, None)
    assert e.value.param == "tools"
    with pytest.raises(BadRequest) as e:
        lt.chat({"messages": [{"role": "user", "content": 5}]}, None)
    assert e.value.param == "messages"


def test_state_settings_are_checked():
    from kvroute import Router, RouterConfig
    from kvroute.gateway.state import LocalState, make_state

    cfg = parse_argv(["--replica", "http://h:1", "--state", "redis://127.0.0.1:6379/0", "--state-timeout", "0.02",
                      "--state-dir", "/tmp/x", "--snapshot-interval", "5"])
    assert (cfg.state, cfg.state_timeout, cfg.state_dir, cfg.snapshot_interval) == (
        "redis://127.0.0.1:6379/0", 0.02, "/tmp/x", 5.0)
    for bad, msg in ((["--state", "memcached://h"], "state must be"), (["--state-timeout", "0"], "state_timeout"),
                     (["--state-load-interval", "3"], "state_load_ttl must exceed"),
                     (["--snapshot-interval", "-1"], "snapshot_interval")):
        with pytest.raises(ValueError, match=msg):
            parse_argv(["--replica", "http://h:1", *bad])
    router = Router(RouterConfig(), ["a"])
    assert isinstance(make_state(None, router, None), LocalState)
    assert isinstance(make_state("local", router, None), LocalState)
    with pytest.raises(ValueError, match="state must be"):
        make_state("http://h", router, None)
    pytest.importorskip("redis")
    from kvroute.gateway.state.redis_store import RedisOptions

    for kw, msg in (({"timeout": 0}, "timeout"), ({"load_ttl": 0.1}, "load_ttl"), ({"stream_maxlen": 0}, "maxlen"),
                    ({"prefix": ""}, "prefix")):
        with pytest.raises(ValueError, match=msg):
            RedisOptions(**kw)


def test_redis_write_queue_is_bounded_oldest_dropped():
    """Writes waiting for Redis (session bindings, route inserts) stay within queue_max each."""
    pytest.importorskip("redis")
    import numpy as np

    from kvroute import Router, RouterConfig
    from kvroute.gateway.state.redis_store import RedisOptions, RedisState

    state = RedisState("redis://127.0.0.1:1/0", Router(RouterConfig(), ["a", "b"]), None, RedisOptions(queue_max=3))
    state.link.up = True  # as if connected: nothing is sent, the writer task is not running
    hashes = np.arange(4, dtype=np.uint64)
    for i in range(5):
        state.routed(f"s{i}", "a" if i % 2 else "b", hashes)
    assert list(state._sessions) == ["s2", "s3", "s4"] and len(state._routes) == 3
    assert state.counts["dropped"] == 4


def test_redis_peer_load_records_that_are_not_records_are_ignored_whole():
    """Another gateway's load record is applied whole or not at all: bad JSON, missing or
    non-numeric fields neither raise (which would end the load exchange) nor count half."""
    pytest.importorskip("redis")
    import json

    from kvroute import Router, RouterConfig
    from kvroute.gateway.state.redis_store import LOAD_FIELDS, RedisState

    router = Router(RouterConfig(), ["a", "b"])
    state = RedisState("redis://127.0.0.1:1/0", router, None)
    good = json.dumps({"t": 99.0, "own": {"a": [2, 100, 1, 7, 3], "b": [1, 0, 0, 0, 0], "gone": [5]}}).encode()
    bad = [b"not json", b"[]", json.dumps({"own": {"a": [1]}}).encode(), json.dumps({"t": "x", "own": {}}).encode(),
           json.dumps({"t": 99.0, "own": {"a": ["x", 1]}}).encode(), json.dumps({"t": 99.0, "own": {"a": "12"}}).encode(),
           json.dumps({"t": 99.0, "own": {"b": [1], "a": [1e400]}}).encode(), json.dumps({"t": 99.0, "own": []}).encode(),
           b'{"t": Infinity, "own": {"a": [1]}}']
    state._apply_peers([None, good, *bad], now=100.0)
    assert state.counts["peers"] == 1
    assert router.load("a")["external"] == dict(zip(LOAD_FIELDS, [2, 100, 1, 7, 3]))
    assert router.load("b")["external"] == dict(zip(LOAD_FIELDS, [1, 0, 0, 0, 0]))
