"""PrefixIndex examples and bad input; every test runs on both implementations.

`impl` runs a test once per implementation; `same` runs a scenario on both and asserts the
same results or the same exception type and message.
"""

from __future__ import annotations

import array
import threading

import numpy as np
import pytest

import kvroute
import kvroute.reference
from common import same

A, B, C, D, E, F = (0x1000 + i for i in range(6))
BIG = (1 << 64) - 5  # above 2**63: exercises the unsigned range


def snapshot(ix):
    """Everything observable about an index, for before/after comparisons."""
    stats = ix.stats()
    stats.pop("bytes")
    live = [r for r in range(ix.num_replicas) if _live(ix, r)]
    return stats, {r: ix.held(r).tolist() for r in live}


def _live(ix, r):
    try:
        ix.blocks(r)
    except IndexError:
        return False
    return True


def test_exported():
    assert kvroute.PrefixIndex is not None
    assert kvroute.reference.PrefixIndex.__doc__


def test_shared_prefix_and_divergence(impl):
    ix = impl.PrefixIndex(3)
    assert ix.insert(0, [A, B, C, D]) == 4
    assert ix.insert(1, [A, B, E]) == 3
    assert ix.insert(1, [A, B]) == 0
    assert ix.match([A, B, C, D, F]).tolist() == [4, 2, 0]
    assert ix.match([A, B, E]).tolist() == [2, 3, 0]
    assert ix.match([B, C]).tolist() == [0, 0, 0]  # not a chain from the root
    assert ix.match([]).tolist() == [0, 0, 0]
    assert ix.match([A, B, C, D]).dtype == np.int32
    assert ix.num_blocks == 5
    s = ix.stats()
    assert (s["blocks"], s["nodes"], s["held"], s["replica_blocks"]) == (5, 3, 7, [4, 3, 0])
    ix.check_invariants()


def test_nodes_split_and_merge(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B, C, D])
    assert ix.stats()["nodes"] == 1
    ix.insert(1, [A, B])
    assert ix.stats()["nodes"] == 2  # [A B]{0,1} -> [C D]{0}
    ix.remove(1, [A, B])
    assert ix.stats()["nodes"] == 1  # merged back
    ix.remove(0, [B])
    assert ix.stats()["nodes"] == 3  # [A]{0} -> [B]{} -> [C D]{0}
    ix.check_invariants()


def test_missing_middle_block_is_a_placeholder(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B, C])
    ix.remove(0, [B])
    assert ix.match([A, B, C]).tolist() == [1, 0]
    s = ix.stats()
    assert (s["blocks"], s["placeholders"]) == (2, 1)
    assert ix.held(0).tolist() == [A, C]
    ix.insert(1, [A, B])  # another replica re-acquires the middle block
    ix.store_after(0, A, [B])
    assert ix.match([A, B, C]).tolist() == [3, 2]
    ix.remove(0, [C])
    ix.remove(0, [A, B])
    ix.remove(1, [A, B])
    assert ix.stats()["placeholders"] == 0 and ix.num_blocks == 0 and ix.stats()["nodes"] == 0
    ix.check_invariants()


def test_placeholder_freed_with_last_descendant(impl):
    ix = impl.PrefixIndex(1)
    ix.insert(0, [A, B, C, D])
    ix.remove(0, [A, B])
    assert ix.stats()["placeholders"] == 2
    ix.remove(0, [D])
    assert ix.stats()["placeholders"] == 2
    ix.remove(0, [C])
    s = ix.stats()
    assert (s["blocks"], s["placeholders"], s["nodes"]) == (0, 0, 0)


def test_store_after(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B])
    assert ix.store_after(1, B, [C, D]) == 2
    assert ix.match([A, B, C, D]).tolist() == [2, 0]  # replica 1 lacks A and B
    assert ix.held(1).tolist() == [C, D]
    assert ix.store_after(0, A, [B, C]) == 1
    assert ix.match([A, B, C, D]).tolist() == [3, 0]


def test_bad_chains_change_nothing():
    def scenario(m):
        ix = m.PrefixIndex(2)
        ix.insert(0, [A, B, C])
        before = snapshot(ix)
        results = []
        for call in (
            lambda: ix.store_after(1, D, [E]),  # unknown parent
            lambda: ix.insert(1, [A, C]),  # C exists under B
            lambda: ix.insert(1, [D, E, D]),  # repeated new block
            lambda: ix.insert(1, [E, E]),
            lambda: ix.insert(1, [A, B, C, D, A]),
            lambda: ix.store_after(1, A, [B, A]),
            lambda: ix.store_after(1, C, [C]),
        ):
            try:
                call()
                results.append("ok")
            except (KeyError, ValueError) as exc:
                results.append((type(exc).__name__, str(exc)))
        assert snapshot(ix) == before
        return results

    same(scenario)
    results = scenario(kvroute.reference)
    assert results[0] == ("KeyError", "'parent block 0x0000000000001003 is unknown'")
    assert results[1] == (
        "ValueError",
        "block 0x0000000000001002 at index 1 is already in the index under a different parent",
    )
    assert "ok" not in results


def test_remove_counts_unknown(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B, C])
    assert ix.remove(0, [C, F, A, C]) == 2
    assert ix.remove(1, [A]) == 0
    assert ix.stats()["unknown_removals"] == 3
    assert ix.match([A, B, C]).tolist() == [0, 0]
    assert ix.held(0).tolist() == [B]


def test_replicas_retire_and_reuse(impl):
    ix = impl.PrefixIndex(3)
    ix.insert(1, [A, B])
    ix.insert(2, [A])
    ix.remove_replica(1)
    assert ix.match([A, B]).tolist() == [0, 0, 1]
    with pytest.raises(IndexError, match=r"^replica 1 was removed$"):
        ix.insert(1, [A])
    with pytest.raises(IndexError, match=r"^replica 3 is out of range \[0, 3\)$"):
        ix.blocks(3)
    ix.remove_replica(0)
    assert ix.add_replica() == 0
    assert ix.add_replica() == 1
    assert ix.add_replica() == 3
    assert ix.num_replicas == 4
    assert ix.blocks(1) == 0 and ix.held(1).tolist() == []
    assert ix.match([A]).tolist() == [0, 0, 1, 0]
    s = ix.stats()
    assert s["live_replicas"] == 4 and s["num_replicas"] == 4


def test_clear_replica_and_clear(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B, C])
    ix.insert(1, [A, B, D])
    ix.clear_replica(0)
    assert ix.match([A, B, C]).tolist() == [0, 2]
    assert ix.blocks(0) == 0
    ix.insert(0, [A])
    ix.clear()
    assert ix.num_blocks == 0 and ix.num_replicas == 2 and ix.stats()["nodes"] == 0
    assert ix.insert(0, [A, B]) == 2
    ix.check_invariants()


def test_capacity_evicts_deepest_first(impl):
    ix = impl.PrefixIndex(2, capacity=3, record_evictions=True)
    assert ix.insert(0, [A, B, C, D, E], now=1.0) == 5
    assert ix.held(0).tolist() == [A, B, C]  # a chain longer than capacity keeps its head
    reps, hashes = ix.pop_evictions()
    assert reps.tolist() == [0, 0] and hashes.tolist() == [E, D]
    assert reps.dtype == np.int32 and hashes.dtype == np.uint64
    ix.insert(0, [A, F], now=2.0)  # F and A refreshed; B then C are the least recent
    assert ix.held(0).tolist() == [A, B, F]
    assert ix.pop_evictions()[1].tolist() == [C]
    ix.touch(0, [B], now=3.0)
    ix.insert(0, [A, B, D], now=4.0)
    assert ix.held(0).tolist() == [A, B, D]
    assert ix.pop_evictions()[1].tolist() == [F]
    assert ix.stats()["evictions"] == 4
    assert ix.pop_evictions()[0].tolist() == []
    ix.insert(1, [A, B, D, E], now=5.0)
    assert ix.blocks(1) == 3
    ix.check_invariants()


def test_ttl_expire_and_clock_clamp(impl):
    ix = impl.PrefixIndex(2, ttl=10.0, record_evictions=True)
    ix.insert(0, [A, B], now=100.0)
    ix.insert(1, [A], now=105.0)
    assert ix.expire(now=109.0) == 0
    assert ix.touch(0, [B, F], now=108.0) == 1
    assert ix.expire(now=110.5) == 1  # A of replica 0, touched at 100
    assert ix.pop_evictions()[1].tolist() == [A]
    assert ix.match([A, B]).tolist() == [0, 1]
    ix.insert(1, [C], now=50.0)  # earlier than the clock: counts as 110.5
    assert ix.expire(now=118.0) == 1  # A of replica 1 (105); B at 108 is not before 108
    assert ix.expire(now=121.0) == 2  # B (108) and C (stamped 110.5, not 50)
    assert ix.stats()["expirations"] == 4
    assert ix.num_blocks == 0


def test_no_tracking_without_capacity_or_ttl(impl):
    ix = impl.PrefixIndex(1, record_evictions=True)
    ix.insert(0, [A, B, C])
    assert ix.expire(now=1e9) == 0
    assert ix.touch(0, [A, C, C, F]) == 3
    assert ix.pop_evictions()[0].tolist() == []
    assert ix.capacity is None and ix.ttl is None and ix.record_evictions is True


def test_hash_argument_forms():
    def scenario(m):
        ix = m.PrefixIndex(1)
        ix.insert(0, [A, B, BIG])
        out = []
        for hashes in (
            [A, B, BIG],
            (A, B, BIG),
            np.array([A, B, BIG], dtype=np.uint64),
            np.array([A, B, BIG], dtype=np.uint64).astype(">u8"),
            np.array([A, B, BIG - (1 << 64)], dtype=np.int64),
            [A, B, BIG - (1 << 64)],
            [np.uint64(A), np.int64(B), BIG],
            np.array([A, 0, B, 0, BIG, 0], dtype=np.uint64)[::2],
            np.array([A, B], dtype=np.int32),
            array.array("Q", [A, B, BIG]),
            np.empty(0, dtype=np.uint64),
        ):
            out.append(ix.match(hashes).tolist())
        return out

    same(scenario)
    results = scenario(kvroute.reference)
    assert all(r == [3] for r in results[:8])
    assert results[8] == [2] and results[-1] == [0]


@pytest.mark.parametrize(
    "hashes, error",
    [
        ("abc", (TypeError, "hashes must be a 1-D integer numpy array, a list or tuple of ints, or an array.array, got str")),
        (np.array([1.0]), (TypeError, "hashes must have an integer dtype, got float64")),
        (np.array([True]), (TypeError, "hashes must have an integer dtype, got bool")),
        (np.zeros((2, 2), dtype=np.uint64), (ValueError, "hashes must be 1-D, got a 2-D array")),
        (np.uint64(5), (TypeError, "hashes must be a 1-D integer numpy array, a list or tuple of ints, or an array.array, got uint64")),
        ([1, "x"], (TypeError, "hashes[1] must be an int, got str")),
        ([1, True], (TypeError, "hashes[1] must be an int, got bool")),
        ([1, 2.0], (TypeError, "hashes[1] must be an int, got float")),
        ([1 << 64], (ValueError, f"hash {1 << 64} at index 0 is out of range [-2**63, 2**64)")),
        ([-(1 << 63) - 1], (ValueError, f"hash {-(1 << 63) - 1} at index 0 is out of range [-2**63, 2**64)")),
        (array.array("d", [1.0]), (TypeError, "hashes must have an integer dtype, got array.array of typecode 'd'")),
    ],
)
def test_bad_hashes(impl, hashes, error):
    ix = impl.PrefixIndex(2)
    ix.insert(0, [A, B])
    before = snapshot(ix)
    for call in (
        lambda: ix.match(hashes),
        lambda: ix.insert(0, hashes),
        lambda: ix.remove(0, hashes),
        lambda: ix.touch(0, hashes),
        lambda: ix.store_after(0, A, hashes),
    ):
        with pytest.raises(error[0]) as info:
            call()
        assert str(info.value) == error[1]
    assert snapshot(ix) == before


def test_bad_arguments_same_errors():
    calls = [
        lambda ix: ix.insert(True, [A]),
        lambda ix: ix.insert("0", [A]),
        lambda ix: ix.insert(-1, [A]),
        lambda ix: ix.insert(1 << 70, [A]),
        lambda ix: ix.insert(7, "bad"),  # replica is checked first
        lambda ix: ix.insert(0, [A], now="soon"),
        lambda ix: ix.insert(0, [A], now=float("nan")),
        lambda ix: ix.insert(0, [A], now=True),
        lambda ix: ix.touch(0, [A], now=float("inf")),
        lambda ix: ix.expire(now="x"),
        lambda ix: ix.store_after(0, "A", [B]),
        lambda ix: ix.store_after(0, 1 << 64, [B]),
        lambda ix: ix.store_after(0, -1, [B]),
        lambda ix: ix.held(2.0),
        lambda ix: ix.blocks(np.int64(5)),
        lambda ix: ix.remove_replica(4),
        lambda ix: ix.clear_replica(-3),
        lambda ix: ix.store_after(9, 1 << 64, "x"),
    ]

    for call in calls:

        def scenario(m, call=call):
            ix = m.PrefixIndex(4)
            ix.insert(0, [A, B])
            before = snapshot(ix)
            try:
                call(ix)
            finally:
                assert snapshot(ix) == before

        kind, (name, message) = same(scenario)
        assert kind == "raise" and name in ("TypeError", "ValueError", "IndexError", "KeyError"), (name, message)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(num_replicas=-1), (ValueError, "num_replicas must be in [0, 65536], got -1")),
        (dict(num_replicas=65537), (ValueError, "num_replicas must be in [0, 65536], got 65537")),
        (dict(num_replicas=2.0), (TypeError, "num_replicas must be an int, got float")),
        (dict(num_replicas=True), (TypeError, "num_replicas must be an int, got bool")),
        (dict(capacity=0), (ValueError, "capacity must be in [1, 2**63), got 0")),
        (dict(capacity=1 << 63), (ValueError, f"capacity must be in [1, 2**63), got {1 << 63}")),
        (dict(capacity=2.5), (TypeError, "capacity must be an int or None, got float")),
        (dict(ttl=0), (ValueError, "ttl must be positive and finite, got 0")),
        (dict(ttl=float("inf")), (ValueError, "ttl must be positive and finite, got inf")),
        (dict(ttl="1"), (TypeError, "ttl must be a number or None, got str")),
        (dict(record_evictions=1), (TypeError, "record_evictions must be a bool, got int")),
    ],
)
def test_bad_constructor(impl, kwargs, error):
    with pytest.raises(error[0]) as info:
        impl.PrefixIndex(**kwargs)
    assert str(info.value) == error[1]


def test_properties(impl):
    ix = impl.PrefixIndex(np.int64(2), capacity=np.int32(5), ttl=3, record_evictions=np.bool_(True))
    assert (ix.num_replicas, ix.capacity, ix.ttl, ix.record_evictions) == (2, 5, 3.0, True)
    s = ix.stats()
    assert (s["capacity"], s["ttl"]) == (5, 3.0)
    assert s["bytes"] > 0
    assert "PrefixIndex" in repr(ix)


def test_many_replicas(impl):
    ix = impl.PrefixIndex(4000)
    for _ in range(100):
        ix.add_replica()
    assert ix.num_replicas == 4100
    ix.insert(4099, [A, B, C])
    ix.insert(63, [A, B])
    ix.insert(64, [A])
    out = ix.match([A, B, C])
    assert out.shape == (4100,)
    assert {i: int(v) for i, v in enumerate(out) if v} == {63: 2, 64: 1, 4099: 3}
    ix.check_invariants()


def test_long_chains_split_and_merge():
    def scenario(m):
        rng = np.random.default_rng(7)
        base = rng.integers(0, 1 << 63, size=3000, dtype=np.uint64)
        ix = m.PrefixIndex(3)
        out = [ix.insert(0, base)]
        out.append(ix.insert(1, base[:1500]))
        out.append(ix.insert(2, np.concatenate([base[:700], rng.integers(0, 1 << 63, 50, dtype=np.uint64)])))
        out.append(ix.remove(0, base[1000:2000:3]))
        out.append(ix.remove(1, base[::-1][:400]))
        ix.check_invariants()
        out.append(ix.match(base).tolist())
        out.append(ix.stats()["nodes"])
        ix.clear_replica(2)
        ix.check_invariants()
        out.append(ix.stats()["nodes"])
        return out

    same(scenario)
    results = scenario(kvroute.reference)
    assert results[:5] == [3000, 1500, 750, 334, 0]
    assert results[5] == [1000, 1500, 700]


@pytest.mark.usefixtures("gil_released")
def test_threads_native_consistent(native):
    ix = native.PrefixIndex(8, capacity=500)
    rng = np.random.default_rng(3)
    trunk = rng.integers(0, 1 << 63, size=64, dtype=np.uint64)
    chains = [np.concatenate([trunk, rng.integers(0, 1 << 63, size=64, dtype=np.uint64)]) for _ in range(32)]
    errors = []

    def worker(w):
        try:
            for i in range(200):
                c = chains[(w * 7 + i) % len(chains)]
                ix.insert(w, c, now=float(i))
                ix.match(c)
                if i % 5 == 0:
                    ix.remove(w, c[-10:])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ix.check_invariants()
    assert all(ix.blocks(w) <= 500 for w in range(4))


def test_replica_limit():
    def scenario(m):
        ix = m.PrefixIndex(65536)
        ix.insert(65535, [A, B])
        out = [ix.match([A, B])[-1]]
        try:
            ix.add_replica()
        except RuntimeError as exc:
            out.append(str(exc))
        ix.remove_replica(7)
        out.append(ix.add_replica())
        return out

    same(scenario)
    assert scenario(kvroute.reference) == [
        2,
        "cannot add a replica: the index already has the maximum of 65536",
        7,
    ]


def test_numpy_scalars_as_arguments(impl):
    ix = impl.PrefixIndex(2)
    ix.insert(np.int32(1), [A, B], now=np.float32(1.5))
    assert ix.store_after(np.uint8(0), np.uint64(A), np.array([B], dtype=np.int64)) == 1
    assert ix.match([A, B]).tolist() == [0, 2]  # replica 0 holds B but not A
    assert ix.remove(np.int64(1), (A,)) == 1
    assert ix.touch(0, [A, B], now=np.int64(3)) == 1


# --- C2: engine block per replica -------------------------------------------------------------


def test_engine_block_rounds_match_down(impl):
    ix = impl.PrefixIndex(3)
    chain = list(range(1, 8))
    for r in range(3):
        ix.insert(r, chain[: 5 + r], 0.0)
    assert ix.engine_block(1) == 1
    ix.set_engine_block(1, 2)
    ix.set_engine_block(2, 4)
    assert ix.engine_block(1) == 2 and ix.engine_block(2) == 4
    assert ix.match(chain).tolist() == [5, 6, 4]
    assert ix.match(chain[:3]).tolist() == [3, 2, 0]
    ix.set_engine_block(2, 1)
    assert ix.match(chain).tolist() == [5, 6, 7]


def test_engine_block_resets_with_a_reused_id(impl):
    ix = impl.PrefixIndex(2)
    ix.set_engine_block(1, 3)
    ix.remove_replica(1)
    assert ix.add_replica() == 1
    assert ix.engine_block(1) == 1


@pytest.mark.parametrize("k", [0, -1, 65537, 2**70, 1.0, True, "2", None])
def test_engine_block_bad_k_same_error(k):
    def call(m):
        ix = m.PrefixIndex(1)
        try:
            ix.set_engine_block(0, k)
        finally:
            assert ix.engine_block(0) == 1
    kind, _ = same(call)
    assert kind == "raise"


@pytest.mark.parametrize("r", [5, -1, 1.5])
def test_engine_block_bad_replica_same_error(r):
    kind, _ = same(lambda m: m.PrefixIndex(2).set_engine_block(r, 2))
    assert kind == "raise"
    kind, _ = same(lambda m: m.PrefixIndex(2).engine_block(r))
    assert kind == "raise"
