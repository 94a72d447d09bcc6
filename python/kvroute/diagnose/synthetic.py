"""Token-level prompts for a simulator workload, optionally behind a volatile header.

kvroute.sim workloads describe prompts by chained block hashes only. The volatile-prefix
detector needs tokens, so each block's tokens are derived from its hash (equal hashes,
equal text, as the workload's sharing intends): printable ASCII bytes, the ids of the
built-in byte tokenizer (kvroute.tokenize.ByteTokenizer), so a decode shows readable
text. A header (e.g. timestamp_header) is prepended to every prompt: the injected
failure mode of the seed.
"""

from __future__ import annotations

import datetime as _dt
from typing import Callable

import numpy as np

from .stream import from_workload

_OFFSETS = np.arange(1 << 16, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)


def block_tokens_from_hashes(hashes: np.ndarray, block_tokens: int) -> np.ndarray:
    """block_tokens printable bytes (32..126) per hash, a pure function of the hash."""
    h = np.asarray(hashes, dtype=np.uint64)[:, None] ^ _OFFSETS[None, :block_tokens]
    with np.errstate(over="ignore"):
        h = h * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(32)
    return (np.uint64(32) + h % np.uint64(95)).astype(np.int64).reshape(-1)


def timestamp_header(t: float) -> str:
    """'Current time: 2026-11-30T09:00:00.123Z' for t seconds after 09:00 UTC (fixed length)."""
    start = _dt.datetime(2026, 11, 30, 9, 0, 0, tzinfo=_dt.timezone.utc)
    stamp = (start + _dt.timedelta(seconds=t)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    return f"Current time: {stamp}Z\n"


def prompts(workload, header: Callable[[float], str] | None = None) -> tuple[list[np.ndarray], list[float]]:
    """Every lookup of the workload (from_workload's order and times) as byte-token ids,
    each behind header(arrival time) if given."""
    stream = from_workload(workload, stores=True)
    bt = workload.block_tokens
    out = []
    times = []
    looked = stream.looked_up()
    for i in range(stream.num_ops):
        if not stream.counted[i]:
            continue
        blocks = stream.blocks(i)
        n = int(stream.prompt_tokens[i])
        body = block_tokens_from_hashes(blocks[: -(-n // bt)], bt)[:n]
        if len(body) < n:  # the partial tail has no following block: its own text
            body = np.concatenate([body, block_tokens_from_hashes(np.array([int(blocks[looked[i] - 1]) ^ 1
                                                                            if looked[i] else i], np.uint64), n - len(body))])
        t = float(stream.arrival[i]) if stream.arrival is not None else 0.0
        if header is not None:
            head = np.frombuffer(header(t).encode(), dtype=np.uint8).astype(np.int64)
            body = np.concatenate([head, body])
        out.append(body)
        times.append(t)
    return out, times


__all__ = ["block_tokens_from_hashes", "prompts", "timestamp_header"]
