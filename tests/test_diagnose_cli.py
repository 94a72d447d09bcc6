"""`kvroute diagnose` end to end: a Mooncake trace and token traces with and without a
volatile header."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvroute import cli, sim
from kvroute.diagnose import synthetic

TRACE = Path(os.environ.get("KVROUTE_TRACE", Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
                            / "conversation_trace.jsonl"))
WL = sim.chat(sim.ChatParams(sessions_per_replica=2, conversations_per_user=2), replicas=2, seed=0)


def _tokens_file(tmp_path: Path, header) -> Path:
    prompts, times = synthetic.prompts(WL, header)
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for p, t in zip(prompts, times):
            f.write(json.dumps({"tokens": p.tolist(), "timestamp": t * 1000, "output_length": 200}) + "\n")
    return path


def test_tokens_trace_with_a_timestamp_header(tmp_path, capsys):
    path = _tokens_file(tmp_path, synthetic.timestamp_header)
    png = tmp_path / "mrc.png"
    assert cli.main(["diagnose", str(path), "--format", "tokens", "--replicas", "2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "VOLATILE PREFIX" in text and "divergence at token" in text and "time: 2026-11-30T09:" in text
    assert png.stat().st_size > 10_000


def test_tokens_trace_clean_json(tmp_path, capsys):
    path = _tokens_file(tmp_path, None)
    assert cli.main(["diagnose", str(path), "--format", "tokens", "--replicas", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["volatile"]["found"] is False and d["volatile"]["prompts"] == WL.num_requests
    assert not any("VOLATILE" in f for f in d["findings"])
    sim_ = d["simulated"]
    assert 0.0 < sim_["router"]["hit_rate"] <= 1.0 and sim_["fraction_of_ideal"]["hit_rate"] > 0.0
    assert sim_["cold"]["requests"] + sim_["warm"]["requests"] == WL.num_requests
    # The MRC at the fleet's memory and the ideal fleet's simulated hit rate tell the same story.
    assert abs(d["pooled_at_fleet_cache"] - sim_["ideal"]["hit_rate"]) < 0.1


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is not checked out")
def test_mooncake_trace(capsys):
    assert cli.main(["diagnose", str(TRACE), "--limit", "2000"]) == 0
    text = capsys.readouterr().out
    assert "2,000 requests" in text and "not checked (this trace has no tokens" in text
    assert "fraction of the ideal" in text and "findings:" in text


def test_errors(tmp_path, capsys):
    assert cli.main(["diagnose", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": "abc"}\n')
    assert cli.main(["diagnose", str(bad), "--format", "tokens"]) == 2
    assert "bad.jsonl:1: not a token-id prompt" in capsys.readouterr().err
