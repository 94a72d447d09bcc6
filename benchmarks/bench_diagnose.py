"""Miss-ratio curve throughput: the target is >= 5M blocks/s on a 10M-block stream.

The stream: the chat workload for 27 replicas (about 10.4M blocks: every turn's prompt
and output blocks, the prompt looked up), fed to mrc.Shards at the default sampling rate
for its length (mrc.default_rate: about 0.03) with 65,536 blocks tracked at most.
blocks/s = stream blocks / median seconds (printed by the test). On a shared machine
wall time includes waiting for a core: also run with the process timer,

A second group times what a gateway pays per request for GET /kvroute/diagnostics:
Diagnostics.observe of one chat request (the pooled and the replica's curve, the volatile
detector one request in four), on a chat stream past its warm-up.

Run: python -m pytest benchmarks/bench_diagnose.py --benchmark-only -s
     python -m pytest benchmarks/bench_diagnose.py --benchmark-only -s --benchmark-timer time.process_time
"""

from __future__ import annotations

import numpy as np

from kvroute import sim
from kvroute.diagnose import mrc
from kvroute.diagnose.live import Diagnostics
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


def _tokens_of(hashes: np.ndarray, prompt_tokens: int, block_tokens: int) -> np.ndarray:
    """Token ids that agree with the block hashes (equal blocks, equal tokens; the partial
    last block zeros): the workload has hashes only, the volatile detector reads tokens."""
    shifts = np.arange(block_tokens, dtype=np.uint64) * np.uint64(3)
    blocks = ((hashes[:, None] >> shifts[None, :]) & np.uint64(0x7FFF)).astype(np.int64).reshape(-1)
    return np.concatenate([blocks, np.zeros(prompt_tokens - len(blocks), dtype=np.int64)])


def test_live_observe_per_request(benchmark):
    """Diagnostics.observe of chat requests spread over 8 replicas, after 10,000 warm-up requests."""
    benchmark.group = "diagnose: live observe, one chat request"
    wl = sim.chat(replicas=64, seed=0)  # ~25,000 requests
    turns = [t for c in wl.clients for t in c.turns][:20_000]
    ops = [(np.asarray(t.hashes, dtype=np.uint64), t.prompt_tokens) for t in turns]
    d = Diagnostics(wl.block_tokens)
    names = [f"r{i}" for i in range(8)]
    for i, (h, p) in enumerate(ops[:10_000]):
        d.observe(h, names[i % 8], prompt_tokens=p, tokens=_tokens_of(h, p, wl.block_tokens))
    it = iter(range(10_000, len(ops)))
    tokens = {i: _tokens_of(*ops[i], wl.block_tokens) for i in range(10_000, len(ops))}

    def once() -> None:
        i = next(it)
        h, p = ops[i]
        d.observe(h, names[i % 8], prompt_tokens=p, tokens=tokens[i])

    benchmark.pedantic(once, rounds=10_000, iterations=1)
    assert d.snapshot()["pooled"]["lookups"] == 20_000
