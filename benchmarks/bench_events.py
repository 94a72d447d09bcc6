"""KV event benchmarks: native vs reference in one group per workload, correctness asserted.

Run: python -m pytest benchmarks/bench_events.py --benchmark-only
     python benchmarks/report.py benchmarks/bench_events.py   (medians and ratios)

Workload: one engine replica, 100 batches of 100 blocks each (4 requests of 25 blocks per
step, each continuing its request's chain from the previous step), block size 16, token ids
drawn from a 152k vocabulary, engine hashes random uint64 as vLLM sends them (int mode).
Each round starts from a warm applier and index (setup, not timed: the same working set was
applied once and then cleared by an AllBlocksCleared, so tables are sized as in a running
system) and applies the 10,000 blocks; blocks/s = 10,000 / round time. Targets (issue 5): decode+apply >= 2,000,000
blocks/s; apply_stored from arrays >= 10,000,000 blocks/s.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvroute._native as native
import kvroute.reference as reference
from kvroute.reference.hashing import block_hashes

IMPLS = {"native": native, "reference": reference}
BS = 16
STEPS = 100
REQUESTS = 4
PER_EVENT = 25  # blocks per request per step: 100 blocks per batch
BLOCKS = STEPS * REQUESTS * PER_EVENT
ROUNDS = {"native": 30, "reference": 3}

_rng = np.random.default_rng(2026)
TOKENS = [_rng.integers(0, 152_000, STEPS * PER_EVENT * BS, dtype=np.uint32) for _ in range(REQUESTS)]
EHASH = [_rng.integers(0, 2**64 - 1, STEPS * PER_EVENT, dtype=np.uint64, endpoint=True) for _ in range(REQUESTS)]
EXPECTED = sorted(int(h) for q in range(REQUESTS) for h in block_hashes(TOKENS[q], BS))


def _event(q: int, step: int, fmt: str):
    lo, hi = step * PER_EVENT, (step + 1) * PER_EVENT
    hashes = EHASH[q][lo:hi].tolist()
    parent = None if step == 0 else int(EHASH[q][lo - 1])
    tokens = TOKENS[q][lo * BS : hi * BS].tolist()
    if fmt == "array":  # vLLM positional, current field count
        return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None, None, 0, "full_attention", None]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def _payloads(fmt: str) -> list[bytes]:
    import msgspec

    enc = msgspec.msgpack.Encoder()
    return [enc.encode([1.7e9 + s, [_event(q, s, fmt) for q in range(REQUESTS)], 0]) for s in range(STEPS)]


PAYLOADS = {"array": _payloads("array"), "map": _payloads("map")}
CLEAR = __import__("msgspec").msgpack.encode([0.0, [["AllBlocksCleared"]], 0])


def _fresh(M):
    idx = M.PrefixIndex(1)
    return (idx, M.EventApplier(idx, BS)), {}


def _warm(M, fmt=None):
    """A running applier: it has held this working set before and the engine then cleared its
    cache (AllBlocksCleared), so its tables are sized, as in steady state."""
    (idx, applier), _ = _fresh(M)
    if fmt is None:
        for hashes, parent, tokens in ARRAYS_100:
            applier.apply_stored(0, hashes, parent, tokens, block_size=BS)
    else:
        for p in PAYLOADS[fmt]:
            applier.apply(0, p)
    assert applier.apply(0, CLEAR) and idx.blocks(0) == 0
    return (idx, applier), {}


def _check(idx, applier):
    assert applier.stats()["malformed"] == 0
    assert idx.blocks(0) == BLOCKS
    assert idx.held(0).tolist() == EXPECTED


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("fmt", ["array", "map"])
def test_decode_apply_100_block_batches(benchmark, impl, fmt):
    """apply(payload) on 100 vLLM batches of 100 blocks (10,000 blocks per round)."""
    M = IMPLS[impl]
    benchmark.group = f"decode+apply vLLM {fmt} batches, 100 x 100 blocks"
    payloads = PAYLOADS[fmt]

    def run(idx, applier):
        for p in payloads:
            applier.apply(0, p)
        return idx, applier

    idx, applier = benchmark.pedantic(run, setup=lambda: _warm(M, fmt), rounds=ROUNDS[impl], iterations=1)
    _check(idx, applier)
    benchmark.extra_info["blocks_per_s"] = BLOCKS / benchmark.stats.stats.median


ARRAYS = [
    (np.ascontiguousarray(EHASH[q][s * PER_EVENT : (s + 1) * PER_EVENT]),
     None if s == 0 else int(EHASH[q][s * PER_EVENT - 1]),
     np.ascontiguousarray(TOKENS[q][s * PER_EVENT * BS : (s + 1) * PER_EVENT * BS]))
    for s in range(STEPS) for q in range(REQUESTS)
]
# The same blocks as 100-block calls: one request's 4 consecutive steps per call.
ARRAYS_100 = [
    (np.ascontiguousarray(EHASH[q][s * 100 : (s + 1) * 100]),
     None if s == 0 else int(EHASH[q][s * 100 - 1]),
     np.ascontiguousarray(TOKENS[q][s * 100 * BS : (s + 1) * 100 * BS]))
    for s in range(STEPS * PER_EVENT // 100) for q in range(REQUESTS)
]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_apply_stored_arrays_100_blocks(benchmark, impl):
    """apply_stored(replica, uint64 hashes, parent, uint32 tokens) in calls of 100 blocks."""
    M = IMPLS[impl]
    benchmark.group = "apply_stored from arrays, 100 calls x 100 blocks"

    def run(idx, applier):
        for hashes, parent, tokens in ARRAYS_100:
            applier.apply_stored(0, hashes, parent, tokens, block_size=BS)
        return idx, applier

    idx, applier = benchmark.pedantic(run, setup=lambda: _warm(M), rounds=ROUNDS[impl], iterations=1)
    _check(idx, applier)
    benchmark.extra_info["blocks_per_s"] = BLOCKS / benchmark.stats.stats.median


@pytest.mark.parametrize("impl", list(IMPLS))
def test_apply_removed_arrays(benchmark, impl):
    """apply_removed of all 10,000 blocks in calls of 25 (engines send one hash per eviction)."""
    M = IMPLS[impl]
    benchmark.group = "apply_removed from arrays, 400 calls x 25 blocks"

    def setup():
        (idx, applier), _ = _fresh(M)
        for hashes, parent, tokens in ARRAYS_100:
            applier.apply_stored(0, hashes, parent, tokens, block_size=BS)
        return (idx, applier), {}

    def run(idx, applier):
        for hashes, _, _ in ARRAYS:
            applier.apply_removed(0, hashes)
        return idx, applier

    idx, applier = benchmark.pedantic(run, setup=setup, rounds=ROUNDS[impl], iterations=1)
    assert idx.blocks(0) == 0 and applier.replica_stats(0)["engine_blocks"] == 0
    benchmark.extra_info["blocks_per_s"] = BLOCKS / benchmark.stats.stats.median
