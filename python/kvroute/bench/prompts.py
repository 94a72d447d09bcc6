"""Workload turns as HTTP prompts: token ids for /v1/completions, messages for chat.

kvroute.sim.workloads describes a prompt by the chained hashes of its full blocks. Over
HTTP each block becomes `block_tokens` tokens derived from its hash alone (a splitmix64 of
hash and position), so prompts that share leading hashes share those leading tokens
exactly, and the tokens of a block never depend on the request. The partial block after
the last full one is derived from the request's own position in the workload, so it is
never shared. Ids lie in [TOKEN_LOW, TOKEN_LOW + TOKEN_RANGE), inside any real model's
vocabulary and below its special tokens.

For /v1/chat/completions the same scheme yields text: one lowercase letter or space per
token, which the emulator's built-in byte-level tokenizer reads as exactly one token each.
The whole prompt is one user message, so a conversation's later prompts extend the
earlier ones' text and the chat template keeps the shared prefix shared.

Limits worth knowing: the server generates its own answer tokens, while a later turn's
prompt here contains the workload's answer blocks, so a server's cache of its own answer
is not reused by the next turn (the simulator assumes it is). kvroute.bench.client
therefore sends chat turns, under the workload's own timing, as a conversation with the
server's real answers (client.conversation); token-id prompts cannot carry them.
"""

from __future__ import annotations

import numpy as np

from ..sim.workloads import Turn

TOKEN_LOW = 1000
TOKEN_RANGE = 20_000
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _raw(turn: Turn, block_tokens: int, tail_key: int) -> np.ndarray:
    """uint64 pseudo-random values, one per prompt token (see the module docstring)."""
    hashes = np.asarray(turn.hashes, dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        body = _mix(hashes[:, None] ^ (pos[None, :] + np.uint64(1)) * _GOLDEN).ravel()
        n_tail = max(0, turn.prompt_tokens - body.size)
        tail = _mix(np.uint64(tail_key) * _GOLDEN + np.arange(n_tail, dtype=np.uint64) + np.uint64(0x5EED))
    return np.concatenate([body, tail])[: turn.prompt_tokens]


def token_prompt(turn: Turn, block_tokens: int, tail_key: int) -> list[int]:
    """The turn's prompt as token ids."""
    raw = _raw(turn, block_tokens, tail_key)
    return (raw % np.uint64(TOKEN_RANGE) + np.uint64(TOKEN_LOW)).astype(np.int64).tolist()


def text_prompt(turn: Turn, block_tokens: int, tail_key: int) -> str:
    """The turn's prompt as text, one ASCII character per token."""
    raw = _raw(turn, block_tokens, tail_key)
    return _ALPHABET[(raw % np.uint64(len(_ALPHABET))).astype(np.intp)].tobytes().decode("ascii")


def chat_messages(turn: Turn, block_tokens: int, tail_key: int) -> list[dict[str, str]]:
    """The turn's prompt as chat messages (one user message)."""
    return [{"role": "user", "content": text_prompt(turn, block_tokens, tail_key)}]


__all__ = ["TOKEN_LOW", "TOKEN_RANGE", "chat_messages", "text_prompt", "token_prompt"]
