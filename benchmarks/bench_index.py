"""PrefixIndex benchmarks: native vs reference in the same group, correctness asserted inside.

Run: python -m pytest benchmarks/bench_index.py --benchmark-only
KVROUTE_BENCH_BIG=10000000 sets the largest index of the size-scaling group (default 10M).

The fleet (build_fleet) is made of realistic chains: a few dozen system prompts of 64-256
blocks with popularity skew, sessions that start from one and extend it turn by turn (each
turn re-inserts the whole conversation so far, as a router does), a tenth of the turns moving
to another replica. On top, 16 probe chains of exactly 512 blocks (a system prompt plus a
conversation) are held in full by one replica and in part by two others; the match and
insert benchmarks cycle through them.
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest

from kvroute import _native as native
from kvroute import reference

IMPLS = {"native": native, "reference": reference}
PROBES = 16
PROBE_LEN = 512
REFERENCE_BLOCKS = 100_000  # the reference twin is built smaller: it takes ~1 us per block visit


def _rand(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 1 << 64, size=n, dtype=np.uint64)


class Fleet:
    """An index plus the probe chains it was built with and who holds them in full."""

    def __init__(self, index, probes: list[np.ndarray], owners: list[int], rng: np.random.Generator) -> None:
        self.index = index
        self.probes = probes
        self.owners = owners
        self.rng = rng


def build_fleet(
    module, num_blocks: int, num_replicas: int, *, seed: int = 1, **index_kwargs
) -> Fleet:
    """An index of about `num_blocks` distinct blocks over `num_replicas` replicas."""
    rng = np.random.default_rng(seed)
    ix = module.PrefixIndex(num_replicas, **index_kwargs)
    n_sys = 32
    systems = [_rand(rng, int(rng.integers(64, 257))) for _ in range(n_sys)]
    weights = 1.0 / np.arange(1, n_sys + 1)
    weights /= weights.sum()
    probes, owners = [], []
    for p in range(PROBES):
        s = systems[p % 4]
        chain = np.concatenate([s, _rand(rng, PROBE_LEN - len(s))])
        owner = int(rng.integers(num_replicas))
        ix.insert(owner, chain, now=0.0)
        for _ in range(2):
            ix.insert(int(rng.integers(num_replicas)), chain[: int(rng.integers(1, PROBE_LEN))], now=0.0)
        probes.append(chain)
        owners.append(owner)
    total = ix.num_blocks
    while total < num_blocks:
        chain = systems[int(rng.choice(n_sys, p=weights))]
        replica = int(rng.integers(num_replicas))
        for _ in range(int(rng.integers(1, 8))):
            new = int(rng.integers(16, 97))
            chain = np.concatenate([chain, _rand(rng, new)])
            if rng.random() < 0.1:
                replica = int(rng.integers(num_replicas))
            ix.insert(replica, chain, now=0.0)
            total += new
    return Fleet(ix, probes, owners, rng)


@functools.lru_cache(maxsize=None)
def fleet(impl: str, num_blocks: int, num_replicas: int, use: str = "read") -> Fleet:
    """A cached fleet; `use` keeps the fleets that benchmarks modify apart from the others."""
    return build_fleet(IMPLS[impl], num_blocks, num_replicas)


def _match_cycle(f: Fleet):
    items = itertools.cycle(list(zip(f.probes, f.owners)))
    match = f.index.match

    def run():
        chain, owner = next(items)
        out = match(chain)
        assert out[owner] == PROBE_LEN
        return out

    return run


# -- match of a 512-block chain --------------------------------------------------------------


@pytest.mark.benchmark(group="index-match-512 (64 replicas)")
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_match_512(benchmark, impl):
    blocks = 1_000_000 if impl == "native" else REFERENCE_BLOCKS
    f = fleet(impl, blocks, 64)
    benchmark.extra_info["index_blocks"] = f.index.num_blocks
    out = benchmark(_match_cycle(f))
    assert out.shape == (64,)


# -- insert of a 512-block chain whose first 500 blocks exist -----------------------------------


@pytest.mark.benchmark(group="index-insert-512 (500 present)")
@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("who", ["same-replica", "other-replica"])
def test_insert_512_500_present(benchmark, impl, who):
    blocks = 1_000_000 if impl == "native" else REFERENCE_BLOCKS
    f = fleet(impl, blocks, 64, use=f"insert-{who}")
    ix = f.index
    counter = itertools.count()
    last: list = []

    def setup():
        if last and who == "other-replica":
            ix.remove(*last.pop())  # untimed: the next round's replica starts without the chain
        i = next(counter)
        p = i % PROBES
        replica = f.owners[p] if who == "same-replica" else (f.owners[p] + 1 + i % 63) % 64
        chain = np.concatenate([f.probes[p][:500], _rand(f.rng, 12)])
        last.append((replica, chain))
        return (replica, chain), {"now": 0.0}

    def insert(replica, chain, now):
        got = ix.insert(replica, chain, now=now)
        if who == "same-replica":
            assert got == 12
        else:
            assert 12 <= got <= 512
        return got

    benchmark.pedantic(insert, setup=setup, rounds=2000 if impl == "native" else 300, iterations=1)


# -- memory --------------------------------------------------------------------------------


def _chains(n_blocks: int, seed: int = 5) -> list[np.ndarray]:
    """Chains of 64-1024 blocks branching off each other, n_blocks distinct blocks in all."""
    rng = np.random.default_rng(seed)
    chains, total = [], 0
    while total < n_blocks:
        if chains and rng.random() < 0.7:
            base = chains[int(rng.integers(len(chains)))]
            base = base[: int(rng.integers(1, len(base) + 1))]
        else:
            base = np.empty(0, dtype=np.uint64)
        new = int(rng.integers(64, 1025))
        chains.append(np.concatenate([base, _rand(rng, new)]))
        total += new
    return chains


@pytest.mark.benchmark(group="index-memory")
@pytest.mark.parametrize("holders", [1, 8])
@pytest.mark.parametrize("tracking", ["off", "capacity+ttl"])
def test_memory_per_block(benchmark, holders, tracking):
    kwargs = {} if tracking == "off" else {"capacity": 1 << 40, "ttl": 1e9}
    ix = native.PrefixIndex(holders, **kwargs)
    for c in _chains(1_000_000):
        for r in range(holders):
            ix.insert(r, c, now=0.0)
    stats = benchmark(ix.stats)
    per_block = stats["bytes"] / stats["blocks"]
    per_pair = stats["bytes"] / stats["held"]
    benchmark.extra_info.update(
        blocks=stats["blocks"], nodes=stats["nodes"], bytes=stats["bytes"],
        bytes_per_block=round(per_block, 2), bytes_per_replica_block=round(per_pair, 2),
    )
    print(f"\n{holders} holder(s), tracking {tracking}: {stats['blocks']} blocks, {stats['nodes']} nodes, "
          f"{per_block:.1f} B/block, {per_pair:.2f} B/(replica, block)")
    if tracking == "off":
        assert per_block <= 40 if holders == 1 else per_pair <= 6


# -- scaling: replicas and index size --------------------------------------------------------


@pytest.mark.benchmark(group="index-match-512 vs replicas")
@pytest.mark.parametrize("replicas", [8, 1024])
def test_match_scaling_replicas(benchmark, replicas):
    f = fleet("native", 1_000_000, replicas)
    out = benchmark(_match_cycle(f))
    assert out.shape == (replicas,)


@pytest.mark.benchmark(group="index-match-512 vs blocks")
@pytest.mark.parametrize("blocks", [10_000, 1_000_000, int(os.environ.get("KVROUTE_BENCH_BIG", 10_000_000))])
def test_match_scaling_blocks(benchmark, blocks):
    f = fleet("native", blocks, 64)
    benchmark.extra_info["index_blocks"] = f.index.num_blocks
    benchmark.extra_info["index_bytes"] = f.index.stats()["bytes"]
    benchmark(_match_cycle(f))


# -- calibration: what this machine charges for any call that returns an array -------------


@pytest.mark.benchmark(group="index-calibration (machine speed)")
@pytest.mark.parametrize("what", ["np.empty(64, int32)", "native no-op call", "native match of 1 absent block"])
def test_calibration(benchmark, what):
    ix = native.PrefixIndex(64)
    absent = np.array([12345], dtype=np.uint64)
    fn = {
        "np.empty(64, int32)": lambda: np.empty(64, np.int32),
        "native no-op call": lambda: ix.num_replicas,
        "native match of 1 absent block": lambda: ix.match(absent),
    }[what]
    benchmark(fn)
