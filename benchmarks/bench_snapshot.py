"""Snapshot and restore benchmarks (contract C7): native vs reference in one group each.

Run: python -m pytest benchmarks/bench_snapshot.py --benchmark-only
(or python benchmarks/report.py benchmarks/bench_snapshot.py for medians and ratios).

The router: approximate mode, 8 replicas, each holding about 100k blocks (KVROUTE_BENCH_SNAP
overrides the per-replica count) in an LRU-tracked index (index_capacity), as conversations:
every replica extends a few shared system prompts with its own sessions, so the trees share
their first blocks. The native router is built by inserting chains; the reference router by
restoring the native router's snapshot (building it by insertion would take minutes).
Correctness is asserted inside: the returned block counts, and restored contents equal.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import pytest

from kvroute import RouterConfig
from kvroute import _native as native
from kvroute import reference

IMPLS = {"native": native, "reference": reference}
REPLICAS = 8
PER_REPLICA = int(os.environ.get("KVROUTE_BENCH_SNAP", "100000"))
CFG = RouterConfig(block_size=16, index_capacity=2 * PER_REPLICA)
T = 1000.0


@functools.lru_cache(maxsize=1)
def source() -> tuple[str, int]:
    """(path of the native router's snapshot, blocks held over all replicas)."""
    rng = np.random.default_rng(7)
    router = native.Router(CFG, [f"r{i}" for i in range(REPLICAS)])
    systems = [rng.integers(0, 1 << 64, size=int(rng.integers(64, 257)), dtype=np.uint64) for _ in range(16)]
    for r in range(REPLICAS):
        held = 0
        t = 0.0
        while held < PER_REPLICA:
            chain = np.concatenate([systems[int(rng.integers(16))], rng.integers(0, 1 << 64, size=512, dtype=np.uint64)])
            router.index.insert(r, chain, now=t)
            t += 0.001
            held = router.index.blocks(r)
    path = os.path.join(tempfile.mkdtemp(prefix="kvroute-bench-snap-"), "source")
    info = router.snapshot(path, now=T)
    return path, info["blocks"]


@functools.lru_cache(maxsize=2)
def loaded(impl: str):
    path, blocks = source()
    router = IMPLS[impl].Router(CFG)
    assert router.restore(path, now=T)["blocks"] == blocks
    return router


@pytest.mark.parametrize("impl", list(IMPLS))
def test_snapshot(benchmark, impl, tmp_path):
    benchmark.group = f"snapshot: {REPLICAS} replicas x {PER_REPLICA} blocks"
    router = loaded(impl)
    _, blocks = source()
    rounds = 5 if impl == "native" else 2
    info = benchmark.pedantic(router.snapshot, args=(str(tmp_path / "s"),), kwargs={"now": T},
                              rounds=rounds, iterations=1)
    assert info["blocks"] == blocks


@pytest.mark.parametrize("impl", list(IMPLS))
def test_restore(benchmark, impl):
    benchmark.group = f"restore: {REPLICAS} replicas x {PER_REPLICA} blocks"
    path, blocks = source()
    M = IMPLS[impl]
    rounds = 5 if impl == "native" else 2

    def fresh():
        return (M.Router(CFG),), {}

    def restore(router):
        return router.restore(path, now=T)

    info = benchmark.pedantic(restore, setup=fresh, rounds=rounds, iterations=1)
    assert info["blocks"] == blocks
