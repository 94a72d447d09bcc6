"""`kvroute bench`: workload prompts over HTTP, the summary, and a run against emulated
engines through the command line (table, --json, --plot)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvroute import sim
from kvroute.bench import prompts
from kvroute.bench.client import BenchConfig, RequestResult
from kvroute.bench.report import summarize, text_table
from kvroute.sim.workloads import Turn


def _turn(hashes, prompt_tokens):
    h = np.asarray(hashes, dtype=np.uint64)
    return Turn(h, prompt_tokens, 4, h)


def test_shared_hashes_give_shared_tokens_and_text():
    a = _turn([1, 2, 3], 50)
    b = _turn([1, 2, 9], 48)
    ta, tb = prompts.token_prompt(a, 16, 0), prompts.token_prompt(b, 16, 1)
    assert (len(ta), len(tb)) == (50, 48)
    assert ta[:32] == tb[:32] and ta[32:48] != tb[32:48]
    assert all(prompts.TOKEN_LOW <= t < prompts.TOKEN_LOW + prompts.TOKEN_RANGE for t in ta + tb)
    # The partial block is the request's own: same hashes, another request, another tail.
    assert prompts.token_prompt(a, 16, 0)[48:] == ta[48:] != prompts.token_prompt(a, 16, 7)[48:]
    xa, xb = prompts.text_prompt(a, 16, 0), prompts.text_prompt(b, 16, 1)
    assert len(xa) == 50 and xa.isascii() and xa[:32] == xb[:32] and xa[32:48] != xb[32:48]
    assert prompts.chat_messages(a, 16, 0) == [{"role": "user", "content": xa}]


def test_a_conversation_prompt_extends_the_previous_one():
    wl = sim.chat(sim.ChatParams(sessions_per_replica=1, conversations_per_user=1, mean_turns=3), 1, seed=3)
    turns = wl.clients[0].turns
    assert len(turns) >= 2
    first, second = (prompts.token_prompt(t, wl.block_tokens, k) for k, t in enumerate(turns[:2]))
    full = len(turns[0].hashes) * wl.block_tokens
    assert first[:full] == second[:full]


def test_summary_of_results():
    rs = [RequestResult(0, 0, 0.0, ttft=0.1, e2e=0.5, tpot=0.01, prompt_tokens=100, cached_tokens=50,
                        completion_tokens=41),
          RequestResult(1, 0, 0.1, ttft=0.3, e2e=0.9, tpot=0.02, prompt_tokens=100, cached_tokens=0,
                        completion_tokens=31),
          RequestResult(2, 0, 0.2, error="http 500"),
          RequestResult(3, 0, 0.3, error="timeout")]
    s = summarize("x", rs, 2.0)
    assert (s.requests, s.completed, s.errors) == (4, 2, 2)
    assert s.errors_by_kind == {"http 500": 1, "timeout": 1}
    assert s.hit_rate == pytest.approx(0.25) and s.ttft_mean == pytest.approx(0.2)
    assert s.ttft_p50 == pytest.approx(0.2) and s.throughput_rps == pytest.approx(1.0)
    table = text_table([s])
    assert "25.0%" in table and "http 500: 1" in table and "1.0 req/s" in table
    assert json.dumps(s.as_dict())
    empty = summarize("y", [], 1.0)
    assert math.isnan(empty.hit_rate) and empty.as_dict()["ttft_mean"] is None


@pytest.mark.parametrize("kwargs,msg", [
    ({"api": "grpc"}, "api"), ({"rate": 1.0, "concurrency": 2}, "at most one"), ({"rate": 0.0}, "rate"),
    ({"concurrency": 0}, "concurrency"), ({"requests": 0}, "requests"), ({"duration": -1.0}, "duration"),
    ({"time_scale": float("inf")}, "time_scale"),
])
def test_bench_config_is_checked(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        BenchConfig(url="http://x", **kwargs)


def test_cli_rejects_bad_arguments(capsys):
    from kvroute.cli import main

    assert main(["bench", "--url", "http://127.0.0.1:9", "--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--workload", "trace", "/no/such/file"]) == 2
    assert main(["emulate", "--replicas", "0"]) == 2
    assert main(["emulate", "--port", "5557", "--replicas", "2"]) == 2
    assert "overlaps" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("uvicorn")
    pytest.importorskip("aiohttp")
    from emulate_util import start_fleet

    ft = start_fleet(1, time_scale=0.01)
    yield ft
    ft.stop()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_against_an_emulated_engine(engines, api, capsys, tmp_path):
    from kvroute.cli import main

    url = engines.fleet.engines[0].url
    plot = tmp_path / "ttft.png"
    assert main(["bench", "--url", url, "--label", "emu", "--workload", "shared-prefix", "--requests", "24",
                 "--concurrency", "6", "--api", api, "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    (res,) = out["results"]
    assert res["label"] == "emu" and res["requests"] == 24 and res["errors"] == 0
    assert res["reported_cached"] == 24 and res["hit_rate"] > 0  # repeated system prompts hit
    assert res["ttft_p50"] > 0 and res["throughput_rps"] > 0
    assert plot.stat().st_size > 0
    assert main(["bench", "--url", url, "--workload", "shared-prefix", "--requests", "4", "--api", api]) == 0
    table = capsys.readouterr().out
    assert "hit rate" in table and url in table


def test_bench_counts_errors_by_kind(engines, capsys):
    from kvroute.cli import main

    url = engines.fleet.engines[0].url
    # A model the server does not serve: every request is answered 404.
    assert main(["bench", "--url", url, "--model", "other", "--workload", "shared-prefix", "--requests", "3",
                 "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["errors_by_kind"] == {"http 404": 3} and res["completed"] == 0
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--workload", "shared-prefix",
                 "--requests", "2", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["errors_by_kind"] == {"connection": 2}


def test_spread_sends_round_robin_over_every_url(engines, capsys):
    import asyncio

    from kvroute.bench import client
    from kvroute.cli import main

    url, dead = engines.fleet.engines[0].url, "http://127.0.0.1:9"
    # One run over both: every second request goes to the server that is not there.
    assert main(["bench", "--url", url, "--url", dead, "--spread", "--workload", "shared-prefix", "--requests", "6",
                 "--concurrency", "1", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["label"] == f"{url}+{dead}" and res["requests"] == 6
    assert res["completed"] == 3 and res["errors_by_kind"] == {"connection": 3}
    cfg = client.BenchConfig(url=url, spread=(url,), requests=4, concurrency=1)
    results, _ = asyncio.run(client.run(cfg, sim.build_workload("shared-prefix", replicas=1)))
    assert sorted(r.target for r in results) == [0, 0, 1, 1] and all(r.error is None for r in results)


def test_chat_turns_carry_the_servers_answers():
    from kvroute.bench.client import conversation

    wl = sim.chat(sim.ChatParams(sessions_per_replica=1, conversations_per_user=1, mean_turns=3), 1, seed=3)
    t0, t1 = wl.clients[0].turns[:2]
    first = conversation(t0, None, wl.block_tokens, 0)
    assert first == prompts.chat_messages(t0, wl.block_tokens, 0)
    second = conversation(t1, (t0, first, "the answer"), wl.block_tokens, 1)
    assert second[:2] == [*first, {"role": "assistant", "content": "the answer"}]
    new_text = prompts.text_prompt(t1, wl.block_tokens, 1)[t0.prompt_tokens + t0.output_tokens:]
    assert second[2] == {"role": "user", "content": new_text} and len(second) == 3
    # A new conversation (first turn) starts over, whatever came before.
    assert conversation(t0, (t1, second, "x"), wl.block_tokens, 0) == first
