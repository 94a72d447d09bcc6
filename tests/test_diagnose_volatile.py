"""The volatile-prefix detector: finds an injected header, reports nothing without one."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute import sim
from kvroute.diagnose import synthetic
from kvroute.diagnose.volatile import VolatilePrefixDetector
from kvroute.tokenize import load_tokenizer

WL = sim.chat(sim.ChatParams(sessions_per_replica=4, conversations_per_user=2), replicas=2, seed=0)


def _run(header, **kwargs) -> VolatilePrefixDetector:
    det = VolatilePrefixDetector(16, **kwargs)
    for p in synthetic.prompts(WL, header)[0]:
        det.observe(p)
    return det


def test_finds_an_injected_timestamp_header():
    rep = _run(synthetic.timestamp_header).report(load_tokenizer(None).decode)
    later_turns = sum(1 for c in WL.clients for t in c.turns if not t.first)
    assert rep.found and rep.affected_prompts >= 0.9 * later_turns
    # "Current time: 2026-11-30T09:" is the same in every prompt; the minutes or seconds differ.
    head = len(synthetic.timestamp_header(0.0))
    assert all(len("Current time: 2026-11-30T09:") <= o < head for o, _ in rep.offsets)
    assert rep.lost_fraction > 0.5
    s = rep.samples[0]
    assert "time: 2026-11-30T09:" in s.text and "⟨" in s.text and s.text != s.earlier_text
    assert s.lost_tokens > 0 and s.earlier < s.prompt


def test_reports_nothing_on_the_clean_workload():
    rep = _run(None).report()
    assert not rep.found and rep.lost_tokens == 0 and rep.samples == [] and rep.prompts == WL.num_requests


def test_header_of_varying_length_is_found():
    # A request id of 1 to 12 digits shifts the blocks: the text still repeats.
    rep = _run(lambda t: f"request {int(t * 1000) % 10 ** (1 + int(t) % 12)}\n").report()
    assert rep.found and rep.lost_fraction > 0.3
    assert all(o < 32 for o, _ in rep.offsets)


def test_shared_system_prompt_is_not_a_finding():
    wl = sim.chat(sim.ChatParams(sessions_per_replica=4, conversations_per_user=2, system_prompt_tokens=1024),
                  replicas=2, seed=1)
    det = VolatilePrefixDetector(16)
    for p in synthetic.prompts(wl)[0]:
        det.observe(p)
    assert not det.report().found


def test_table_is_bounded():
    det = _run(synthetic.timestamp_header, max_entries=200)
    assert len(det._table) <= 200
    assert det.report().found  # still found from the sampled table


@pytest.mark.parametrize("kwargs, exc", [({"window": 0}, ValueError), ({"max_entries": 1.5}, TypeError),
                                         ({"block_size": True}, TypeError)])
def test_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        VolatilePrefixDetector(**kwargs)


def test_bad_tokens():
    with pytest.raises(ValueError, match="tokens"):
        VolatilePrefixDetector().observe(np.zeros((2, 2)))
