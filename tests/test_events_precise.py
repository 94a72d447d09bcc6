"""Precise mode against the engines' encodings (issue 9 cases 1, 5-9; issue 11 items 2, 7, 8):
each case written as byte payloads in every engine encoding that can express it
(tests/kv_keys.py), run on both implementations with equal outcomes (common.same)."""

from __future__ import annotations

import threading

import msgspec
import pytest

from common import same
from conftest import load_impl
from kv_keys import FORMATS, VLLM, removed, stored

import kvroute.reference as R

ENC = msgspec.msgpack.Encoder().encode
T = list(range(5000, 5128))  # 128 tokens: 8 router blocks of 16


def batch(events: list, ts: float = 1.0) -> bytes:
    return ENC([ts, events, 0])


def kv(tokens, bs=16, **keys):
    return [int(h) for h in R.block_hashes(tokens, bs, **keys)]


def both(fn):
    """fn on both implementations: equal outcomes; returns the reference's result."""
    same(fn)
    return fn(load_impl("reference"))


def fresh(M, n=1, **kw):
    idx = M.PrefixIndex(n)
    return idx, M.EventApplier(idx, **kw)


# -- case 1: event-level application ------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_removal_beside_an_unknown_parent_still_applies(fmt):
    def run(M):
        idx, a = fresh(M)
        a.clear_replica(0)  # what the subscriber does on a resync
        a.apply(0, batch([stored(fmt, [11, 12], None, T[:32], 16)]))
        before = idx.match(kv(T[:32])).tolist()
        ok = a.apply(0, batch([removed(fmt, [11]), stored(fmt, [21], 777, T[32:48], 16),
                               removed(fmt, [999]), stored(fmt, [31], None, T[64:80], 16)]))
        rs = a.replica_stats(0)
        return before, ok, idx.match(kv(T[:32])).tolist(), idx.match(kv(T[64:80])).tolist(), rs["skipped"]

    before, ok, after, other, skipped = both(run)
    assert before == [2] and ok and after == [0] and other == [1]
    assert skipped["unknown_parent"] == 1 and skipped["unknown_removal"] == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_undecodable_batch_is_skipped_whole(fmt):
    def run(M):
        idx, a = fresh(M)
        good = batch([stored(fmt, [11], None, T[:16], 16)])
        bad = batch([stored(fmt, [12], None, T[16:32], 16), ["BlockStored", "not hashes"]])
        return a.apply(0, good[:-3]), a.apply(0, bad), a.stats()["malformed"], idx.blocks(0)

    assert both(run) == (False, False, 2, 0)


# -- case 5: engine blocks larger than the router's ---------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ebs", [32, 64])
def test_larger_engine_blocks_round_matches_down(fmt, ebs):
    def run(M):
        idx, a = fresh(M)
        n = 128 // ebs
        a.apply(0, batch([stored(fmt, list(range(1, n + 1)), None, T, ebs)]))
        probes = [T[:20], T[:48], T[:ebs], T[: ebs + 16], T]
        out = [idx.match(kv(p)).tolist()[0] for p in probes]
        a.apply(0, batch([removed(fmt, [n])]))
        return out, idx.match(kv(T)).tolist()[0], idx.engine_block(0), a.replica_stats(0)["engine_block"]

    out, after, k, k_stats = both(run)
    k_want = ebs // 16
    # A 20-token prompt matches 1 router block, but the engine reuses whole engine blocks: 0.
    assert out == [0, 48 // ebs * k_want, k_want, k_want, 8] and after == 8 - k_want
    assert k == k_stats == k_want


# -- case 6: engine blocks smaller than the router's (SGLang pages) -----------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page", [1, 4, 5])
def test_pages_aggregate_into_router_blocks(fmt, page):
    def run(M):
        idx, a = fresh(M)
        n = 80 // page  # pages stored one event each, chained (the last one may end mid-block)
        events = [stored(fmt, [100 + i], None if i == 0 else 100 + i - 1, T[i * page : (i + 1) * page], page)
                  for i in range(n)]
        a.apply(0, batch(events))
        full = idx.match(kv(T)).tolist()[0], a.replica_stats(0)["engine_block"]
        # The engine evicts the pages covering tokens 40..: router blocks 2.. are no longer whole.
        a.apply(0, batch([removed(fmt, [100 + i]) for i in range(n - 1, 40 // page - 1, -1)]))
        partial = idx.match(kv(T)).tolist()[0]
        # A store continuing from a parent that ends mid-block (token 40 is inside block 2).
        a.apply(0, batch([stored(fmt, [500], 100 + 40 // page - 1, T[40 // page * page : 64], 64 - 40 // page * page)]))
        regrown = idx.match(kv(T)).tolist()[0]
        # A middle page goes: every router block containing its tokens goes with it.
        a.apply(0, batch([removed(fmt, [100 + 20 // page])]))
        middle = idx.match(kv(T)).tolist()[0], idx.blocks(0)
        a.apply(0, batch([removed(fmt, [100 + i for i in range(n)] + [500])]))
        empty = idx.blocks(0), a.replica_stats(0)["engine_blocks"]
        return full, partial, regrown, middle, empty

    full, partial, regrown, middle, empty = both(run)
    assert full == ((80 // page * page) // 16, 1)
    assert partial == (40 // page * page) // 16
    assert regrown == 4
    assert middle == (1, 3)  # blocks 0 and 2, 3 stay; block 1 (tokens 16..31) lost page 20
    assert empty == (0, 0)  # memory follows what the engine holds


@pytest.mark.parametrize("fmt", ["sglang", "sglang-map"])
def test_one_event_of_many_one_token_pages(fmt):
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored(fmt, list(range(1, 41)), None, T[:40], 1)]))
        return idx.match(kv(T)).tolist()[0], sorted(idx.held(0).tolist()) == sorted(kv(T[:32]))

    assert both(run) == (2, True)


# -- case 7: duplicate announcements ------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_reuse_reports_never_outlive_the_removal(fmt):
    def run(M):
        idx, a = fresh(M)
        ev = stored(fmt, [1, 2, 3], None, T[:48], 16)
        a.apply(0, batch([ev]))
        for _ in range(3):  # kv_cache_report_mode="full": the hits re-announced, identical
            a.apply(0, batch([ev]))
        held = idx.match(kv(T[:48])).tolist()[0]
        a.apply(0, batch([removed(fmt, [3]), removed(fmt, [2]), removed(fmt, [1])]))
        s = a.stats()
        return held, idx.match(kv(T[:48])).tolist()[0], s["duplicate_stores"], a.replica_stats(0)["engine_blocks"]

    assert both(run) == (3, 0, 9, 0)


def test_duplicate_rule_is_per_medium_and_group():
    def run(M):
        gpu, cpu = M.PrefixIndex(1), M.PrefixIndex(1)
        a = M.EventApplier(gpu, tier_index=cpu)
        a.apply(0, batch([stored("vllm-map", [1], None, T[:16], 16, medium="GPU"),
                          stored("vllm-map", [1], None, T[:16], 16, medium="CPU")]))
        a.apply(0, batch([removed("vllm-map", [1], medium="GPU")]))
        return gpu.blocks(0), cpu.blocks(0), a.replica_stats(0)["engine_blocks"]

    assert both(run) == (0, 1, 1)


# -- case 8: per-request keys -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_and_salt_keys_match_block_hashes(fmt):
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored(fmt, [1, 2], None, T[:32], 16, lora="adapter-a", salt="tenant")]))
        a.apply(0, batch([stored(fmt, [3], 2, T[32:48], 16, lora="adapter-a")]))
        keyed = idx.match(kv(T[:48], lora="adapter-a", cache_salt="tenant")).tolist()[0]
        base = idx.match(kv(T[:48])).tolist()[0]
        other = idx.match(kv(T[:48], lora="adapter-b", cache_salt="tenant")).tolist()[0]
        return keyed, base, other

    keyed, base, other = both(run)
    # SGLang 0.5.18 has no LoRA field: its store keys by the salt alone.
    if fmt == "sglang":
        assert base == 0
    else:
        assert (keyed, base, other) == (3, 0, 0)


@pytest.mark.parametrize("fmt", VLLM)
def test_multimodal_items_from_extra_keys(fmt):
    # An image of 20 tokens at offset 20: vLLM keys block 1 with (id, 4) and block 2 with
    # (id, -12); kvroute keys the block it starts in, with its absolute offset.
    mm = [[], [["img-1", 4]], [["img-1", -12]], []]

    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored(fmt, [1, 2, 3, 4], None, T[:64], 16, mm=mm)]))
        return (idx.match(kv(T[:64], mm=[("img-1", 20, 20)])).tolist()[0],
                idx.match(kv(T[:64], mm=[("img-2", 20, 20)])).tolist()[0],
                idx.match(kv(T[:64])).tolist()[0])

    assert both(run) == (4, 1, 1)


@pytest.mark.parametrize("fmt", VLLM)
def test_multimodal_item_inside_an_engine_block_of_two_router_blocks(fmt):
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored(fmt, [1, 2], None, T[:64], 32, mm=[[["img", 20]], []])]))
        return idx.match(kv(T[:64], mm=[("img", 20, 8)])).tolist()[0], idx.match(kv(T[:64])).tolist()[0]

    assert both(run) == (4, 0)


@pytest.mark.parametrize("extra", [[[b"\x01" * 32]], [["img-hash-without-offset", "x"]], [[7]], [["a", "b"]]])
def test_unreproducible_keys_skip_the_event(extra):
    def run(M):
        idx, a = fresh(M)
        ok = a.apply(0, batch([stored("vllm-map", [1], None, T[:16], 16, extra=extra),
                               stored("vllm-map", [2], None, T[16:32], 16)]))
        return ok, idx.blocks(0), a.replica_stats(0)["skipped"]["unsupported_keys"], a.stats()["unsupported_events"]

    assert both(run) == (True, 1, 1, 1)


# -- case 9: hybrid models (KV-cache groups) ----------------------------------------------------


@pytest.mark.parametrize("fmt", VLLM)
def test_groups_intersect(fmt):
    def run(M):
        idx, a = fresh(M)
        out = []
        a.apply(0, batch([stored(fmt, [1, 2, 3, 4], None, T[:64], 16, group=0)]))
        out.append(idx.match(kv(T[:64])).tolist()[0])
        # The sliding-window group holds 3 of them: the engine reuses only what every group can.
        a.apply(0, batch([stored(fmt, [1, 2, 3], None, T[:48], 16, group=1)]))
        out.append(idx.match(kv(T[:64])).tolist()[0])
        a.apply(0, batch([removed(fmt, [2], group=1)]))
        out.append(idx.match(kv(T[:64])).tolist()[0])
        a.apply(0, batch([stored(fmt, [2], 1, T[16:32], 16, group=1)]))
        out.append(idx.match(kv(T[:64])).tolist()[0])
        a.apply(0, batch([removed(fmt, [1], group=0)]))
        out.append(idx.match(kv(T[:64])).tolist()[0])
        return out, a.replica_stats(0)["groups"]

    assert both(run) == ([4, 3, 1, 3, 0], [0, 1])


def test_group_block_sizes_set_the_engine_block():
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-map", [1, 2], None, T[:64], 32, group=0),
                          stored("vllm-map", [1], None, T[:64], 64, group=1)]))
        return idx.engine_block(0), idx.match(kv(T[:64])).tolist()[0], idx.match(kv(T[:48])).tolist()[0]

    assert both(run) == (4, 4, 0)


def test_unsupported_group_is_skipped():
    def run(M):
        idx, a = fresh(M)
        a.apply(0, batch([stored("vllm-array", [1], None, T[:16], 16, group=64),
                          removed("vllm-array", [1], group=-1)]))
        return idx.blocks(0), a.replica_stats(0)["skipped"]["unsupported_group"]

    assert both(run) == (0, 2)


# -- issue 11: bounded maps, all-or-nothing apply, nesting depth ---------------------------------


def test_maps_stay_within_the_index_capacity():
    def run(M):
        idx = M.PrefixIndex(1, capacity=50)
        a = M.EventApplier(idx)
        for i in range(40):
            a.apply(0, batch([stored("vllm-map", [10_000 + 25 * i + j], None, [i, j] + T[:14], 16)
                              for j in range(25)]))
        rs = a.replica_stats(0)
        # The oldest entries left the map; their removal is unknown and cannot over-claim.
        a.apply(0, batch([removed("vllm-map", [10_000])]))
        return rs["engine_blocks"], rs["index_blocks"], idx.blocks(0), a.stats()["map_evictions"], \
            a.replica_stats(0)["skipped"]["unknown_removal"]

    engine_blocks, index_blocks, held, evicted, unknown = both(run)
    assert engine_blocks == 50 and index_blocks == held <= 50 and evicted == 950 and unknown == 1


def test_page_maps_stay_within_capacity_times_pages_per_block():
    def run(M):
        idx = M.PrefixIndex(1, capacity=4)
        a = M.EventApplier(idx)
        a.apply(0, batch([stored("sglang", [1 + i], None if i == 0 else i, [T[i]], 1) for i in range(128)]))
        return a.replica_stats(0)["engine_blocks"], idx.blocks(0)

    engine_blocks, held = both(run)
    assert engine_blocks == 64 and held <= 4


def test_replica_removed_from_the_tier_index_refuses_before_changing_anything():
    def run(M):
        gpu, cpu = M.PrefixIndex(2), M.PrefixIndex(2)
        a = M.EventApplier(gpu, tier_index=cpu)
        cpu.remove_replica(1)
        payload = batch([stored("vllm-map", [1], None, T[:16], 16, medium="GPU"),
                         stored("vllm-map", [2], None, T[:16], 16, medium="CPU")])
        try:
            a.apply(1, payload)
        finally:
            assert gpu.blocks(1) == 0 and a.replica_stats(1)["engine_blocks"] == 0

    kind, (name, message) = same(run)
    assert (kind, name, message) == ("raise", "IndexError", "replica 1 was removed")


@pytest.mark.parametrize("name", ["native", "reference"])
@pytest.mark.usefixtures("gil_released")
def test_apply_racing_remove_replica_leaves_nothing_half_applied(name):
    M = load_impl(name)
    idx = M.PrefixIndex(2)
    a = M.EventApplier(idx)
    payloads = [batch([stored("vllm-map", [1000 * i + j for j in range(8)], None, T, 16)]) for i in range(200)]
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            try:
                idx.remove_replica(1)
            except IndexError:
                pass
            idx.add_replica()

    t = threading.Thread(target=churn)
    t.start()
    try:
        for p in payloads:
            try:
                a.apply(1, p)
            except IndexError:
                pass  # removed while applying: nothing of it may stay
    finally:
        stop.set()
        t.join()
    # Whatever interleaving happened, the index holds nothing the applier's map forgot: removing
    # every engine hash ever stored leaves the replica empty.
    everything = [1000 * i + j for i in range(200) for j in range(8)]
    a.apply(1, batch([stored("vllm-map", [1], None, T[:16], 16), removed("vllm-map", everything + [1])]))
    assert idx.blocks(1) == 0 and a.replica_stats(1)["engine_blocks"] == 0
    idx.check_invariants()


@pytest.mark.parametrize("depth", [1, 5, 30, 31, 32, 33, 40, 600])
def test_nesting_depth_limit_is_the_same(depth):
    # The batch array, its events array and the event are 3 containers; `nested` the rest.
    nested: object = 0
    for _ in range(depth - 3):
        nested = [nested]
    payload = ENC([1.0, [["Unknown", nested]]]) if depth >= 3 else ENC([1.0, []])

    def run(M):
        a = M.EventApplier(M.PrefixIndex(1))
        return a.apply(0, payload), a.stats()["last_error"]

    ok, error = both(run)
    assert ok == (depth <= 32) and (ok or error == "payload is not valid msgpack")


def test_resync_keeps_the_engine_block_the_router_configured():
    def run(M):
        idx, a = fresh(M)
        idx.set_engine_block(0, 2)  # e.g. Router.add_replica(engine_block_size=32)
        a.apply(0, batch([stored("vllm-map", [1, 2], None, T[:64], 32)]))
        a.clear_replica(0)
        kept = idx.engine_block(0), a.replica_stats(0)["engine_block"], idx.blocks(0)
        a.apply(0, batch([stored("vllm-map", [1], None, T[:64], 64)]))  # a restart with 64
        return kept, idx.engine_block(0)

    assert both(run) == ((2, 2, 0), 4)
