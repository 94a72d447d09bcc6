"""Incremental chat tokenization: turn 20 of a ~100K-token conversation, tokenized from the
session's previous turn vs in full (goal: under 5% of full), and the built-in byte tokenizer.

The tokenizer is a byte-level BPE trained here (tests/tokenizers_fixture.py, ChatML and
Llama-3 templates); transformers' apply_chat_template on the same folder is in the group too,
so the ratio to what a gateway would otherwise call is visible.

Run: python -m pytest benchmarks/bench_tokenize.py --benchmark-only
     python benchmarks/report.py benchmarks/bench_tokenize.py   (medians and ratios)
"""

from __future__ import annotations

import random
import warnings

import pytest

from kvroute.tokenize import IncrementalEncoder, load_tokenizer
from tests.tokenizers_fixture import CORPUS, train_folder

TURNS = 20
TARGET_TOKENS = 100_000


def _conversation(tok, turns: int, target: int) -> list[dict[str, str]]:
    """`turns` user/assistant pairs of corpus sentences, about `target` tokens in all."""
    rnd = random.Random(7)
    words = " ".join(CORPUS).split()
    per_message = max(1, target // (2 * turns))
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(2 * turns):
        text, n = [], 0
        while n < per_message:
            sentence = " ".join(rnd.choice(words) for _ in range(12)) + ". "
            text.append(sentence)
            n += len(tok.encode(sentence))
        messages.append({"role": ("user", "assistant")[i % 2], "content": "".join(text)})
    return messages


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def setup(request, tmp_path_factory):
    folder = train_folder(str(tmp_path_factory.mktemp(request.param)), request.param)
    tok = load_tokenizer(folder)
    msgs = _conversation(tok, TURNS, TARGET_TOKENS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer

        reference = AutoTokenizer.from_pretrained(folder)
    return request.param, folder, tok, reference, msgs


def _primed(tok, msgs):
    """An encoder that has seen turn 19's prompt (up to the 19th user message)."""
    enc = IncrementalEncoder(tok)
    enc.encode_chat("s", msgs[:-3])
    return enc


def test_turn20_incremental(benchmark, setup):
    kind, _, tok, _, msgs = setup
    benchmark.group = f"turn {TURNS} of a ~{TARGET_TOKENS // 1000}K-token chat ({kind})"
    full = tok.encode_chat(msgs[:-1])
    assert len(full) > 0.9 * TARGET_TOKENS * (2 * TURNS - 1) / (2 * TURNS)

    def run():
        enc = _primed(tok, msgs)  # setup excluded below via pedantic
        return enc

    def target(enc):
        return enc.encode_chat("s", msgs[:-1])

    got = benchmark.pedantic(target, setup=lambda: ((run(),), {}), rounds=15)
    assert got.tolist() == full


def test_turn20_full(benchmark, setup):
    kind, _, tok, _, msgs = setup
    benchmark.group = f"turn {TURNS} of a ~{TARGET_TOKENS // 1000}K-token chat ({kind})"
    got = benchmark.pedantic(tok.encode_chat, args=(msgs[:-1],), rounds=15)
    assert len(got) > 0


def test_turn20_transformers(benchmark, setup):
    kind, _, tok, reference, msgs = setup
    benchmark.group = f"turn {TURNS} of a ~{TARGET_TOKENS // 1000}K-token chat ({kind})"
    got = benchmark.pedantic(reference.apply_chat_template, args=(msgs[:-1],),
                             kwargs={"add_generation_prompt": True}, rounds=5)
    assert list(got["input_ids"]) == tok.encode_chat(msgs[:-1])
