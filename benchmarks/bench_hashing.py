"""Block hashing benchmarks: native and reference in one group per workload, each result
checked against a naive chain computed once with the xxhash package.

Run: python -m pytest benchmarks/bench_hashing.py --benchmark-only
     python benchmarks/report.py benchmarks/bench_hashing.py   (medians and ratios)
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

import kvroute._native as native
import kvroute.reference as reference

IMPLS = {"native": native, "reference": reference}
N_TOKENS = 8192
BLOCK_SIZE = 16

_TOKENS = np.random.default_rng(2026).integers(0, 128_000, N_TOKENS).astype(np.int32)
INPUTS = {
    "int32": _TOKENS,
    "uint32": _TOKENS.astype(np.uint32),
    "int64": _TOKENS.astype(np.int64),
    "list": _TOKENS.tolist(),
}


def _naive_chain(tokens: list[int], block_size: int) -> list[int]:
    seed = xxhash.xxh3_64_intdigest(b"", 0)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *tokens[start : start + block_size]), seed)
        out.append(seed)
    return out


EXPECTED = np.array(_naive_chain(_TOKENS.tolist(), BLOCK_SIZE), dtype=np.uint64)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_block_hashes_8192_int32(benchmark, impl):
    """The issue's target: 8,192 int32 tokens at block size 16 (512 chained XXH3 calls)."""
    benchmark.group = "block_hashes 8192 tokens, block 16, int32 array"
    got = benchmark(IMPLS[impl].block_hashes, INPUTS["int32"], BLOCK_SIZE)
    assert np.array_equal(got, EXPECTED)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kind", ["uint32", "int64", "list"])
def test_block_hashes_8192_input_kinds(benchmark, impl, kind):
    """The same prompt as other accepted input kinds (int64 and list need a conversion)."""
    benchmark.group = f"block_hashes 8192 tokens, block 16, {kind}"
    got = benchmark(IMPLS[impl].block_hashes, INPUTS[kind], BLOCK_SIZE)
    assert np.array_equal(got, EXPECTED)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_block_hashes_short_prompt(benchmark, impl):
    """A 64-token prompt: the per-call overhead the router pays on every route()."""
    benchmark.group = "block_hashes 64 tokens, block 16, int32 array"
    got = benchmark(IMPLS[impl].block_hashes, INPUTS["int32"][:64], BLOCK_SIZE)
    assert np.array_equal(got, EXPECTED[:4])


@pytest.mark.parametrize("impl", list(IMPLS))
def test_xxh3_64_one_mib(benchmark, impl):
    """Throughput of the long-input path (stripes, blocks, scrambling) with a seed."""
    benchmark.group = "xxh3_64 1 MiB, seeded"
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    got = benchmark(IMPLS[impl].xxh3_64, data, 12345)
    assert got == xxhash.xxh3_64_intdigest(data, 12345)
