"""Applying KV events to a PrefixIndex: chains, reference counts, parents, block sizes,
media, errors. Every scenario runs on both implementations (`same`) and checks the result."""

from __future__ import annotations

import numpy as np
import pytest

from common import same
from conftest import load_impl
from kv_wire import batch, cleared, removed, stored

import kvroute.reference as R

T = list(range(1000, 1064))  # 64 tokens: 4 router blocks of 16


def kv(tokens, bs=16, salt=None):
    return [int(h) for h in R.block_hashes(tokens, bs, salt=salt)]


def both(fn):
    """Run fn on both implementations, assert equal outcomes, return the reference result."""
    same(fn)
    return fn(load_impl("reference"))


def fresh(M, n=2, **kw):
    idx = M.PrefixIndex(n)
    return idx, M.EventApplier(idx, **kw)


@pytest.mark.parametrize("fmt", ["vllm-array", "vllm-map", "sglang"])
def test_chain_across_batches_matches_router_hashes(fmt):
    def run(M):
        idx, a = fresh(M)
        assert a.apply(1, batch([stored(fmt, [11, 12], None, T[:32], 16)]))
        assert a.apply(1, batch([stored(fmt, [13], 12, T[32:48], 16)]))
        return idx.held(1).tolist(), idx.match(kv(T)).tolist(), idx.blocks(0)

    held, match, other = both(run)
    assert held == sorted(kv(T[:48])) and match == [0, 3] and other == 0


def test_parent_stored_earlier_in_the_same_batch():
    def run(M):
        idx, a = fresh(M)
        ok = a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16),
                               stored("vllm-array", [2, 3], 1, T[16:48], 16)]))
        return ok, idx.match(kv(T)).tolist()

    assert both(run) == (True, [3, 0])


def test_duplicate_stores_count_once():
    # Case 7 (reuse reports, kv_cache_report_mode="full"): a repeated store of one (hash,
    # medium, group) is no second copy; the engine's one removal drops the block.
    def run(M):
        idx, a = fresh(M)
        out = []
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        for _ in range(2):
            a.apply(0, batch([removed("vllm-array", [1])]))
            out.append(idx.blocks(0))
        s = a.stats()
        return out, s["stored_blocks"], s["duplicate_stores"], s["removed_blocks"], s["unknown_removals"]

    assert both(run) == ([0, 0], 1, 1, 1, 1)


def test_two_engine_hashes_for_one_kvroute_block():
    # E.g. two LoRA adapters: different engine hashes, same tokens, so the same kvroute block.
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-map", [1], None, T[:16], 16), stored("vllm-map", [2], None, T[:16], 16)]))
        a.apply(0, batch([removed("vllm-map", [1])]))
        first = idx.blocks(0)
        a.apply(0, batch([removed("vllm-map", [2])]))
        return first, idx.blocks(0), a.replica_stats(0)["engine_blocks"]

    assert both(run) == (1, 0, 0)


def test_unknown_parent_skips_that_event_alone():
    def run(M):
        idx, a = fresh(M)
        ok = a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16),
                               stored("vllm-array", [3], 99, T[16:32], 16),
                               stored("vllm-array", [2], 1, T[16:32], 16)]))
        s, rs = a.stats(), a.replica_stats(0)
        return ok, idx.blocks(0), s["last_error"], s["malformed"], s["unknown_parents"], rs["skipped"]["unknown_parent"]

    assert both(run) == (True, 2, None, 0, 1, 1)


def test_parent_removed_earlier_in_batch_is_still_a_parent():
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        ok = a.apply(0, batch([removed("vllm-array", [1]), stored("vllm-array", [2], 1, T[16:32], 16)]))
        # The next batch no longer knows block 1: its store is skipped alone.
        ok2 = a.apply(0, batch([stored("vllm-array", [3], 1, T[16:32], 16)]))
        return ok, ok2, idx.held(0).tolist(), a.stats()["index_conflicts"], a.stats()["unknown_parents"]

    # The child is mapped (the engine holds it), but the index freed its parent, so it cannot
    # place the child: counted as an index conflict. Nothing could match it anyway, since
    # matching needs the parent first.
    assert both(run) == (True, True, [], 1, 1)


def test_clear_in_batch_forgets_earlier_parents():
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        first = a.apply(0, batch([cleared("vllm-array"), stored("vllm-array", [2], 1, T[16:32], 16)]))
        mid = idx.blocks(0), a.stats()["unknown_parents"]
        good = a.apply(0, batch([cleared("vllm-array"), stored("vllm-array", [5], None, T[:16], 16),
                                 stored("vllm-array", [6], 5, T[16:32], 16)]))
        return first, mid, good, idx.blocks(0), a.stats()["clears"]

    assert both(run) == (True, (0, 1), True, 2, 2)


@pytest.mark.parametrize("engine_bs", [32, 64])
def test_engine_block_multiple_is_rechunked(engine_bs):
    def run(M):
        idx, a = fresh(M)
        k = engine_bs // 16
        n = 64 // engine_bs
        a.apply(0, batch([stored("vllm-array", list(range(1, n + 1)), None, T[:64], engine_bs)]))
        held = idx.held(0).tolist()
        a.apply(0, batch([removed("vllm-array", [n])]))
        return held, idx.blocks(0), k

    held, left, k = both(run)
    assert held == sorted(kv(T)) and left == 4 - k


def test_misaligned_engine_block_carries_its_tail():
    # 24-token engine blocks against 16-token router blocks: block 1 spans both engine blocks.
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:24], 24)]))
        first = idx.held(0).tolist()
        a.apply(0, batch([stored("vllm-array", [2], 1, T[24:48], 24)]))
        second = idx.held(0).tolist(), idx.engine_block(0)
        a.apply(0, batch([removed("vllm-array", [1])]))
        return first, second, idx.held(0).tolist()

    first, (second, k), third = both(run)
    assert first == kv(T[:16]) and second == sorted(kv(T[:48])) and k == 1
    # Without engine block 1, router blocks 0 and 1 (which holds 8 of its tokens) are gone.
    assert third == [kv(T[:48])[2]]


def test_media_go_to_tiers():
    def run(M):
        gpu, cpu = M.PrefixIndex(1), M.PrefixIndex(0)
        a = M.EventApplier(gpu, tier_index=cpu)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16, "GPU"),
                          stored("vllm-array", [1], None, T[:16], 16, "CPU"),
                          stored("vllm-array", [2], 1, T[16:32], 16, "CPU")]))
        mid = gpu.blocks(0), cpu.blocks(0), cpu.num_replicas
        a.apply(0, batch([removed("vllm-array", [1], "GPU")]))
        after = gpu.blocks(0), cpu.blocks(0), a.replica_stats(0)
        a.apply(0, batch([cleared("vllm-array")]))
        return mid, after, gpu.blocks(0), cpu.blocks(0)

    mid, (g, c, rs), g2, c2 = both(run)
    assert mid == (1, 2, 1) and (g, c) == (0, 2) and rs["tier_blocks"] == 2 and (g2, c2) == (0, 0)


def test_other_media_without_tier_index_are_only_counted():
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("sglang", [1], None, T[:16], 16, "DISK")]))
        return idx.blocks(0), a.replica_stats(0)["tier_blocks"], a.replica_stats(0)["engine_blocks"]

    assert both(run) == (0, 0, 1)


def test_salt_is_the_chain_root():
    def run(M):
        idx, a = fresh(M, salt="tenant-a")
        a.apply(0, batch([stored("vllm-map", [1, 2], None, T[:32], 16)]))
        return idx.held(0).tolist(), bytes(a.salt)

    held, salt = both(run)
    assert held == sorted(kv(T[:32], salt="tenant-a")) and held != sorted(kv(T[:32])) and salt == b"tenant-a"


def test_array_api_equals_payload_api():
    def run(M):
        idx, a = fresh(M)
        n1 = a.apply_stored(0, np.array([1, 2], dtype=np.uint64), None, np.array(T[:32], dtype=np.int32))
        n2 = a.apply_stored(0, [-3], 2, T[32:64], block_size=32, medium="GPU")  # 32 tokens, 2 blocks
        held = idx.held(0).tolist()
        r = a.apply_removed(0, [2, 2, (1 << 64) - 3])
        return n1, n2, held, r, idx.held(0).tolist()

    n1, n2, held, r, after = both(run)
    hs = kv(T[:32]) + [int(h) for h in R.block_hashes(T[:64], 16)[2:]]
    assert (n1, n2, r) == (2, 1, 2) and held == sorted(hs)
    assert after == sorted([hs[0]])


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda a: a.apply_stored(0, [1], 5, T[:16]), ("KeyError", "'parent block hash 5 is unknown on replica 0'")),
        (lambda a: a.apply_stored(0, [1, 2], None, T[:17]), ("ValueError", "17 token_ids do not make 2 blocks")),
        (lambda a: a.apply_stored(0, [1], None, T[:17], block_size=16),
         ("ValueError", "17 token_ids do not make 1 blocks of 16 tokens")),
        (lambda a: a.apply_stored(0, [1], None, T[:16], medium=3), ("TypeError", "medium must be a str or None, got int")),
        (lambda a: a.apply_stored(0, [1.0], None, T[:16]), ("TypeError", "block_hashes[0] must be an int, got float")),
        (lambda a: a.apply_stored(0, [1], "x", T[:16]), ("TypeError", "parent_block_hash must be an int, got str")),
        (lambda a: a.apply_stored(0, [1], None, [-1] * 16), ("ValueError", "token -1 at index 0 is out of range [0, 2**32)")),
        (lambda a: a.apply_stored(0, [1], None, T[:16], block_size=0), ("ValueError", "block_size must be in [1, 65536], got 0")),
        (lambda a: a.apply_removed(0, [1], medium=b"GPU"), ("TypeError", "medium must be a str or None, got bytes")),
        (lambda a: a.apply(2, b""), ("IndexError", "replica 2 is out of range [0, 2)")),
        (lambda a: a.apply(-1, b""), ("IndexError", "replica -1 is out of range [0, 2)")),
        (lambda a: a.apply(1 << 70, b""), ("IndexError", f"replica {1 << 70} is out of range [0, 2)")),
        (lambda a: a.apply(True, b""), ("TypeError", "replica must be an int, got bool")),
        (lambda a: a.clear_replica("0"), ("TypeError", "replica must be an int, got str")),
        (lambda a: a.replica_stats(5), ("IndexError", "replica 5 is out of range [0, 2)")),
    ],
)
def test_bad_arguments_raise_before_any_change(call, expected):
    def run(M):
        idx, a = fresh(M)
        try:
            call(a)
        finally:
            assert idx.num_blocks == 0 and a.stats()["stored_blocks"] == 0
        return None

    assert same(run) == ("raise", expected)


def test_removed_replica_is_rejected():
    def run(M):
        idx, a = fresh(M)
        idx.remove_replica(1)
        return a.apply(1, b"")

    assert same(run) == ("raise", ("IndexError", "replica 1 was removed"))


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda M: M.EventApplier(object()), ("TypeError", "index must be a PrefixIndex, got object")),
        (lambda M: M.EventApplier(M.PrefixIndex(1), tier_index=3), ("TypeError", "tier_index must be a PrefixIndex or None, got int")),
        (lambda M: M.EventApplier(M.PrefixIndex(1), 0), ("ValueError", "block_size must be in [1, 65536], got 0")),
        (lambda M: M.EventApplier(M.PrefixIndex(1), salt=3), ("TypeError", "salt must be str, bytes or None, got int")),
    ],
)
def test_constructor_errors(make, expected):
    assert same(make) == ("raise", expected)


def test_tier_index_must_differ():
    def run(M):
        ix = M.PrefixIndex(1)
        return M.EventApplier(ix, tier_index=ix)

    assert same(run) == ("raise", ("ValueError", "tier_index must be a different PrefixIndex than index"))


def test_replicas_are_independent_and_properties():
    def run(M):
        idx, a = fresh(M, n=3, block_size=16)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        a.apply(2, batch([stored("vllm-array", [1], None, T[16:32], 16)], ts=7.0))
        a.apply(2, batch([removed("vllm-array", [1])]))
        return (idx.match(kv(T[:16])).tolist(), a.replica_stats(2), a.replica_stats(1), a.block_size,
                a.index is idx, a.tier_index, repr(a))

    m, r2, r1, bs, same_index, tier, rep = both(run)
    assert m == [1, 0, 0] and r2["batches"] == 2 and r2["engine_blocks"] == 0 and r1["batches"] == 0
    assert bs == 16 and same_index and tier is None and rep == "EventApplier(block_size=16)"


def test_backend_choice_is_exported():
    import kvroute
    import kvroute.events as ev

    assert kvroute.EventApplier is ev.EventApplier
    assert ev.EventApplier in (load_impl("native").EventApplier, load_impl("reference").EventApplier)


def test_events_module_needs_neither_zmq_nor_msgspec_to_import():
    import subprocess
    import sys

    code = ("import sys, kvroute.events, kvroute.reference; "
            "print('zmq' in sys.modules, 'msgspec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("impl_name", ["native", "reference"])
@pytest.mark.usefixtures("gil_released")
def test_concurrent_appliers_and_readers(impl_name):
    """Replicas fed from four threads while another matches: every replica ends exact."""
    import threading

    from kv_wire import Engine

    M = load_impl(impl_name)
    idx = M.PrefixIndex(4)
    a = M.EventApplier(idx)
    engines = [Engine("vllm-array", 12, 16, 16) for _ in range(4)]
    rng = np.random.default_rng(5)
    streams = [[batch(e.serve(T[: 16 * int(rng.integers(1, 5))] + rng.integers(0, 3, 32).tolist()))
                 for _ in range(60)] for e in engines]
    errors: list[BaseException] = []

    def feed(r):
        try:
            for p in streams[r]:
                assert a.apply(r, p)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        idx.match(kv(T))
        a.stats()
    for t in threads:
        t.join()
    assert not errors
    for r, e in enumerate(engines):
        assert idx.held(r).tolist() == e.truth()


def test_per_replica_salt():
    def run(M):
        idx, a = fresh(M, salt="model")
        a.set_salt(1, b"lora-7")
        for r in (0, 1):
            a.apply(r, batch([stored("vllm-array", [1, 2], None, T[:32], 16)]))
        held = idx.held(0).tolist(), idx.held(1).tolist(), a.replica_stats(1)["salt"]
        a.set_salt(1, None)
        a.clear_replica(1)
        a.apply(1, batch([stored("vllm-array", [1], None, T[:16], 16)]))
        return held, idx.held(1).tolist(), a.replica_stats(1)["salt"]

    (h0, h1, s1), after, s_after = both(run)
    assert h0 == sorted(kv(T[:32], salt="model")) and h1 == sorted(kv(T[:32], salt="lora-7"))
    assert s1 == b"lora-7" and s_after == b"model" and after == [kv(T[:16], salt="model")[0]]


def test_set_salt_errors():
    def run(M):
        return fresh(M)[1].set_salt(0, 5)

    assert same(run) == ("raise", ("TypeError", "salt must be str, bytes or None, got int"))
