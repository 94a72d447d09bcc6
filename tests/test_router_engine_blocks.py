"""Engine-granular matches (issue 10 section 4, contract C2): a replica whose engine block is
k router blocks reuses whole engine blocks only, so its match is rounded down to a multiple
of k before scoring, in Decision.matched_blocks and cached_tokens too."""

from __future__ import annotations

import pytest

from kvroute.config import RouterConfig

HASHES = list(range(1, 11))  # 10 router blocks of 16 tokens


def make(impl, policy="ttft", mode="precise", **kw):
    r = impl.Router(RouterConfig(policy=policy, mode=mode, params={"min_match_tokens": 0}, block_size=16, **kw))
    r.add_replica("big", engine_block_size=64)  # k = 4
    r.add_replica("small")
    return r


def test_engine_block_sizes_map_to_router_blocks(impl):
    r = impl.Router(RouterConfig(block_size=16))
    for name, size, k in [("a", None, 1), ("b", 16, 1), ("c", 8, 1), ("d", 1, 1), ("e", 48, 3), ("f", 256, 16)]:
        r.add_replica(name, engine_block_size=size)
        assert r.engine_block(name) == k


@pytest.mark.parametrize(
    "size, exc, msg",
    [
        (24, ValueError, "engine_block_size must be a multiple of block_size (16) or at most it, got 24"),
        (0, ValueError, "engine_block_size must be in [1, 1048576], got 0"),
        (2**20 + 16, ValueError, "engine_block_size must be in [1, 1048576], got 1048592"),
        (2**70, ValueError, f"engine_block_size must be in [1, 1048576], got {2**70}"),
        (64.0, TypeError, "engine_block_size must be an int or None, got float"),
        (True, TypeError, "engine_block_size must be an int or None, got bool"),
        ("64", TypeError, "engine_block_size must be an int or None, got str"),
    ],
)
def test_bad_engine_block_size_changes_nothing(impl, size, exc, msg):
    r = impl.Router(RouterConfig(block_size=16), ["a"])
    with pytest.raises(exc) as info:
        r.add_replica("b", engine_block_size=size)
    assert msg in str(info.value)
    assert r.replicas == ["a"] and r.index.num_replicas == 1


def test_index_match_is_rounded_down_to_whole_engine_blocks(impl):
    r = make(impl)
    r.index.insert(0, HASHES)  # big holds 10 router blocks = 2.5 engine blocks
    d = r.route_hashes(HASHES, 160, now=0.0)
    assert (d.replica, d.matched_blocks, d.cached_tokens, d.reason) == ("big", 8, 128, "affinity")
    r.finish(d.handle)
    r.index.insert(1, HASHES[:9])  # small holds 9 whole blocks: longer than big's usable 8
    d = r.route_hashes(HASHES, 160, now=0.0)
    assert (d.replica, d.matched_blocks, d.cached_tokens) == ("small", 9, 144)
    assert r.load("small")["queued_prefill_tokens"] == 16


def test_pending_and_speculative_matches_are_rounded_too(impl):
    r = make(impl, mode="hybrid")
    first = r.route_hashes(HASHES, 160, now=0.0)
    assert first.replica == "big"  # never chosen, lower id
    r.drain("small")
    d = r.route_hashes(HASHES, 160, now=0.0)  # pending twin and speculative entry: 10 -> 8
    assert (d.replica, d.matched_blocks, d.cached_tokens) == ("big", 8, 128)
    assert r.load("big")["prefill_blocks"] == 10 + 2


def test_a_tie_after_rounding_is_a_tie(impl):
    r = make(impl, policy="linear")
    r.index.insert(0, HASHES[:3])  # big: 3 blocks -> 0 whole engine blocks
    d = r.route_hashes(HASHES, 160, now=0.0)
    assert (d.replica, d.matched_blocks, d.reason) == ("big", 0, "miss")
