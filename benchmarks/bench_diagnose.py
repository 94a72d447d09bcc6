"""Miss-ratio curve throughput: the target is >= 5M blocks/s on a 10M-block stream.

The stream: the chat workload for 27 replicas (about 10.4M blocks: every turn's prompt
and output blocks, the prompt looked up), fed to mrc.Shards at the default sampling rate
for its length (mrc.default_rate: about 0.03) with 65,536 blocks tracked at most.
blocks/s = stream blocks / median seconds (printed by the test). On a shared machine
wall time includes waiting for a core: also run with the process timer,

Run: python -m pytest benchmarks/bench_diagnose.py --benchmark-only -s
     python -m pytest benchmarks/bench_diagnose.py --benchmark-only -s --benchmark-timer time.process_time
"""

from __future__ import annotations

import numpy as np

from kvroute import sim
from kvroute.diagnose import mrc
from kvroute.diagnose import stream as bs

_STREAM: list[bs.BlockStream] = []


def _stream() -> bs.BlockStream:
    if not _STREAM:
        _STREAM.append(bs.from_workload(sim.chat(replicas=27, seed=0)))
    return _STREAM[0]


def test_shards_10m_blocks(benchmark):
    """Fixed-size SHARDS over ~10M blocks at the default rate."""
    benchmark.group = "diagnose: miss-ratio curve, 10M-block chat stream"
    stream = _stream()
    n = len(stream.hashes)
    assert n >= 10_000_000

    def run() -> mrc.Curve:
        est = mrc.Shards(stream.block_tokens, rate=mrc.default_rate(n)).feed(stream)
        return est.curve(mrc.default_sizes(4_000_000, 32))

    curve = benchmark.pedantic(run, rounds=3, iterations=1)
    assert curve.tracked <= 65_536 and curve.blocks == int(stream.looked_up().sum())
    assert 0.5 < curve.hit_rate[-1] <= 1.0 and np.all(np.diff(curve.hit_rate) >= -1e-9)
    print(f"\n{n:,} blocks, median {benchmark.stats['median']:.2f} s: "
          f"{n / benchmark.stats['median'] / 1e6:.1f}M blocks/s at rate {curve.rate:.4f}")
