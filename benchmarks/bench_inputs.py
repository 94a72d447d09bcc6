"""Argument conversion cost (issue 10 section 6): match() of 512 hashes given as a numpy array,
an array.array('Q'), a memoryview and a Python list, against numpy.asarray of the same list.

Run: python -m pytest benchmarks/bench_inputs.py --benchmark-only --benchmark-group-by=group

Targets: every buffer of uint64 within noise of numpy (read in place, no conversion); a list
converted at least as fast as numpy.asarray(list, dtype=numpy.uint64) alone.
"""

from __future__ import annotations

import array

import numpy as np
import pytest

from kvroute import _native as native

N = 512


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(3)
    chain = rng.integers(0, 1 << 64, N, dtype=np.uint64)
    ix = native.PrefixIndex(8)
    ix.insert(3, chain)
    return ix, chain


FORMS = {
    "numpy": lambda c: c,
    "array.array": lambda c: array.array("Q", c.tolist()),
    "memoryview": lambda c: memoryview(c),
    "list": lambda c: c.tolist(),
}


@pytest.mark.benchmark(group="match-512-inputs")
@pytest.mark.parametrize("form", list(FORMS))
def test_match_input_forms(benchmark, setup, form):
    ix, chain = setup
    arg = FORMS[form](chain)
    got = benchmark(ix.match, arg)
    assert got[3] == N and got.sum() == N


@pytest.mark.benchmark(group="match-512-inputs")
def test_numpy_asarray_of_the_list(benchmark, setup):
    _, chain = setup
    values = chain.tolist()
    got = benchmark(np.asarray, values, dtype=np.uint64)
    assert (got == chain).all()


@pytest.mark.benchmark(group="tokens-8192-inputs")
@pytest.mark.parametrize("form", ["numpy-int32", "list", "array.array-i", "numpy.asarray-list"])
def test_block_hashes_input_forms(benchmark, form):
    tokens = np.random.default_rng(5).integers(0, 50_000, 8192).astype(np.int32)
    want = native.block_hashes(tokens, 16)
    if form == "numpy.asarray-list":
        values = tokens.tolist()
        got = benchmark(np.asarray, values, dtype=np.uint32)
        assert (got == tokens).all()
        return
    arg = {"numpy-int32": tokens, "list": tokens.tolist(), "array.array-i": array.array("i", tokens.tolist())}[form]
    got = benchmark(native.block_hashes, arg, 16)
    assert (got == want).all()
