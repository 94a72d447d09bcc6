"""Floods: every resource stays within the bound docs/architecture.md names for it
("Memory is bounded by configuration").

Each flood checks the structure's own counters (index blocks and bytes, session count and id
bytes, requests in flight, engine-hash map entries, eviction log length), which tests can
read exactly on both implementations; where a counter could lie about native memory, the
process's resident set is checked too, with a margin far below what an unbounded structure
would take.

Replay streams are flooded where the subscriber's publishers live: tests/test_events_sequence.py
(a replay that never ends stays within max_buffer_bytes and stalls no other publisher; held
batches beyond a hole are capped).
"""

from __future__ import annotations

import os

import numpy as np

from conftest import load_impl
from kvroute.config import RouterConfig

MIB = 1 << 20


def rss() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return 0


def rss_is_meaningful() -> bool:
    """False under AddressSanitizer (scripts/sanitize.sh), whose quarantine keeps freed
    memory resident by design; the counters are checked there all the same."""
    return "libasan" not in os.environ.get("LD_PRELOAD", "")


def unique_prompt(i: int, blocks: int = 4, block_size: int = 16) -> np.ndarray:
    """A prompt no other i shares a first block with."""
    out = np.arange(blocks * block_size, dtype=np.int64) + 7
    out[0] = i
    return out


def test_unique_prompt_flood_stays_within_index_capacity(impl):
    cap = 200
    cfg = RouterConfig(policy="ttft", mode="approximate", block_size=16, index_capacity=cap)
    router = impl.Router(cfg, [f"r{i}" for i in range(4)])
    sizes = []
    for i in range(2400):
        d = router.route(unique_prompt(i), now=float(i))
        router.prefill_done(d.handle, now=float(i))
        router.finish(d.handle, now=float(i))
        if i % 600 == 599:
            stats = router.index.stats()
            assert max(stats["replica_blocks"]) <= cap
            sizes.append(stats["bytes"])
    assert router.index.stats()["evictions"] > 0  # the flood did reach the bound
    # Full from the first checkpoint on (4 x 200 blocks), and flat after that.
    assert max(sizes[1:]) <= sizes[0] * 1.1 + 4096, sizes


def test_session_flood_stays_within_max_sessions(impl):
    cfg = RouterConfig(policy="ttft", block_size=16, max_sessions=300)
    router = impl.Router(cfg, ["a", "b"])
    for i in range(1500):
        d = router.route([1] * 32, session=f"user-{i}", now=float(i))
        router.finish(d.handle, now=float(i))
        assert router.stats()["sessions"] <= 300


def test_session_id_bytes_stay_within_max_session_bytes(impl):
    limit = 1 * MIB
    cfg = RouterConfig(policy="ttft", block_size=16, max_session_bytes=limit)
    router = impl.Router(cfg, ["a", "b"])
    before = rss()
    for i in range(120):
        session = f"{i:08d}" + "x" * (256 * 1024)  # 120 ids of 256 KiB: 30 MiB unbounded
        d = router.route([1] * 32, session=session, now=float(i))
        router.finish(d.handle, now=float(i))
        stats = router.stats()
        assert stats["session_bytes"] <= limit
    assert stats["sessions"] <= 4
    if rss_is_meaningful():
        assert rss() - before < 16 * MIB


def test_leaked_handles_expire_after_request_ttl(impl):
    cfg = RouterConfig(policy="ttft", block_size=16, request_ttl=5.0)
    router = impl.Router(cfg, ["a", "b"])
    for i in range(1500):
        router.route(unique_prompt(i, blocks=1), now=i * 0.1)  # never finished
        # Everything routed more than request_ttl ago is gone: at most 51 remain.
        assert router.stats()["in_flight"] <= 51


def _stored_event_flood(M, n: int):
    index = M.PrefixIndex(1, capacity=500)
    applier = M.EventApplier(index, 16)
    tokens = np.arange(16, dtype=np.int64)
    for i in range(n):
        tokens[0] = i  # every block is a distinct root block
        applier.apply_stored(0, [1_000_000 + i], None, tokens)
    return index, applier


def test_stored_event_flood_maps_follow_index_capacity(impl):
    index, applier = _stored_event_flood(impl, 3000)
    st = applier.replica_stats(0)
    assert index.num_blocks <= 500
    assert st["index_blocks"] <= 500 and st["engine_blocks"] <= 500, st


def test_eviction_log_never_popped_stays_within_its_limit(native):
    from kvroute.reference.index import EVICTION_LOG_LIMIT

    ix = native.PrefixIndex(1, capacity=1000, record_evictions=True)
    rng = np.random.default_rng(1)
    chunk = 4096
    for i in range(EVICTION_LOG_LIMIT // chunk + 8):
        ix.insert(0, rng.integers(1, 1 << 63, chunk, dtype=np.uint64), now=float(i))
    stats = ix.stats()
    assert stats["eviction_log"] <= EVICTION_LOG_LIMIT
    assert stats["evictions_dropped"] > 0  # the flood went past the limit
    assert stats["blocks"] <= 1000

