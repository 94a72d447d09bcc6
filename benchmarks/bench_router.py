"""Router benchmarks: route() of an 8,192-token int32 prompt (hashing included) against an
index of 1,000,000 blocks, native and reference in one group per fleet size.

Each timed call is route() followed by finish() of its handle, so the fleet's load stays
constant across rounds; the decision is checked inside the benchmark. A second group
times route_hashes() (no hashing) to separate the router's own cost from the hash chain.

Run: python -m pytest benchmarks/bench_router.py --benchmark-only
"""

from __future__ import annotations

import numpy as np
import pytest

import kvroute._native as native
import kvroute.reference as reference
from kvroute.config import RouterConfig

IMPLS = {"native": native, "reference": reference}
N_TOKENS = 8192
BLOCK_SIZE = 16
INDEX_BLOCKS = 1_000_000
CHAIN = 500  # blocks per background chain: 2,000 chains fill the index
HOLDER = 3  # the replica that holds the prompt's first HELD blocks
HELD = 300

_rng = np.random.default_rng(2026)
PROMPT = _rng.integers(0, 128_000, N_TOKENS).astype(np.int32)
_CHAINS = [_rng.integers(0, 2**63, CHAIN, dtype=np.int64).astype(np.uint64) for _ in range(INDEX_BLOCKS // CHAIN)]
_cache: dict[tuple[str, int, str], object] = {}


def router(impl: str, replicas: int, mode: str):
    """A ttft router over `replicas` replicas whose index holds 1,000,000 blocks."""
    key = (impl, replicas, mode)
    if key not in _cache:
        _cache.clear()  # one big index alive at a time
        mod = IMPLS[impl]
        r = mod.Router(RouterConfig(policy="ttft", block_size=BLOCK_SIZE, mode=mode), [f"r{i}" for i in range(replicas)])
        for i, chain in enumerate(_CHAINS):
            r.index.insert(i % replicas, chain)
        r.index.insert(HOLDER, mod.block_hashes(PROMPT, BLOCK_SIZE)[:HELD])
        assert r.index.num_blocks == INDEX_BLOCKS + HELD
        _cache[key] = r
    return _cache[key]


def _bench(benchmark, impl, r, fn, expected_matched):
    def once():
        d = fn()
        r.finish(d.handle)
        return d

    if impl == "native":
        d = benchmark(once)
    else:
        d = benchmark.pedantic(once, rounds=100, iterations=1, warmup_rounds=3)
    assert d.replica_id == HOLDER and d.matched_blocks == expected_matched and d.prompt_tokens == N_TOKENS
    assert r.stats()["in_flight"] == 0


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("replicas", [64, 1024])
def test_route_8192_tokens_precise(benchmark, impl, replicas):
    """route(): hash 512 blocks, match them over every replica, choose, reserve (precise mode)."""
    benchmark.group = f"route 8192 tokens, {replicas} replicas, 1M-block index, precise"
    r = router(impl, replicas, "precise")
    _bench(benchmark, impl, r, lambda: r.route(PROMPT), HELD)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_route_8192_tokens_approximate(benchmark, impl):
    """route() in approximate mode: also inserts the prompt's 512 blocks under the choice."""
    benchmark.group = "route 8192 tokens, 64 replicas, 1M-block index, approximate"
    r = router(impl, 64, "approximate")
    r.finish(r.route(PROMPT).handle)  # the holder now holds the whole prompt
    _bench(benchmark, impl, r, lambda: r.route(PROMPT), N_TOKENS // BLOCK_SIZE)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_route_hashes_512_blocks(benchmark, impl):
    """route_hashes(): the same decision from precomputed hashes (the router without hashing)."""
    benchmark.group = "route_hashes 512 blocks, 64 replicas, 1M-block index, precise"
    r = router(impl, 64, "precise")
    hashes = IMPLS[impl].block_hashes(PROMPT, BLOCK_SIZE)
    _bench(benchmark, impl, r, lambda: r.route_hashes(hashes, N_TOKENS), HELD)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_route_hashes_512_blocks_external_load(benchmark, impl):
    """route_hashes() with other routers' load set on every replica (contract C6): the same
    decision at the same cost (policies read own + external sums kept up to date)."""
    benchmark.group = "route_hashes 512 blocks, 64 replicas, 1M-block index, precise"
    r = router(impl, 64, "precise")
    hashes = IMPLS[impl].block_hashes(PROMPT, BLOCK_SIZE)
    external = dict(in_flight=3, queued_prefill_tokens=4096, prefill_requests=2, prefill_blocks=256, decode_blocks=512)
    for name in r.replicas:
        r.set_external_load(name, **external)
    try:
        _bench(benchmark, impl, r, lambda: r.route_hashes(hashes, N_TOKENS), HELD)
    finally:
        for name in r.replicas:
            r.set_external_load(name)


_sticky: dict[str, object] = {}


def sticky_router(impl: str):
    """A sticky router over 256 replicas x 1,024 virtual nodes (a 262,144-position ring)."""
    if impl not in _sticky:
        _sticky.clear()
        r = IMPLS[impl].Router(RouterConfig(policy="sticky", params={"vnodes": 1024}))
        for i in range(256):
            r.add_replica(f"replica-{i}")
        _sticky[impl] = r
    return _sticky[impl]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sticky_membership_change(benchmark, impl):
    """remove_replica + add_replica of one replica on a 262,144-position ring: the ring is
    updated in place (native: O(vnodes log ring); reference: a merge, O(ring))."""
    benchmark.group = "sticky: remove + add one replica, 256 replicas x 1024 vnodes"
    r = sticky_router(impl)

    def once():
        r.remove_replica("replica-7")
        r.add_replica("replica-7")

    if impl == "native":
        benchmark(once)
    else:
        benchmark.pedantic(once, rounds=5, iterations=1, warmup_rounds=1)
    assert len(r.replicas) == 256
    assert r.route_hashes([], 0, session="user").reason == "hash"
