"""Decoding KV event batches: every wire layout of kv-events.md, hash normalization, and
malformed payloads. Decoding is checked on kvroute.events.decode (pure Python) and, through
EventApplier.apply, differentially on the native msgpack reader."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common import same
from conftest import load_impl
from kv_wire import batch, cleared, removed, stored

from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    decode,
)

ENC = msgspec.msgpack.encode
TOKS = list(range(100, 132))
BIG = 15760518052499183552  # from the kthena capture: >= 2**63, sent as 0xcf


def applied(payload: bytes):
    """Outcome of applying one payload to replica 0 of a fresh index, per implementation."""

    def run(M):
        idx = M.PrefixIndex(1)
        a = M.EventApplier(idx, 16)
        ok = a.apply(0, payload)
        return ok, a.stats(), a.replica_stats(0), idx.held(0).tolist()

    same(run)
    return run(load_impl("reference"))


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [5, 6, 7, 8, 9, 11])
def test_vllm_positional_every_version_length(fields):
    ev = stored("vllm-array", [1, 2], None, TOKS, 16, fields=fields)
    assert len(ev) == fields + 1
    b = decode(batch([ev]))
    want = BlockStored((1, 2), None, tuple(TOKS), 16, "GPU" if fields >= 6 else None,
                       group_idx=0 if fields >= 9 else None)
    assert b.events == (want,)
    assert applied(batch([ev]))[0] is True


def test_vllm_positional_bytes_exactly():
    # [ts, [["BlockStored", [BIG], nil, tokens(16), 16, nil, "GPU"]], 0] written byte by byte.
    tokens = bytes([0xDC, 0x00, 0x10]) + bytes(range(16))  # array16: more than 15 elements
    ev = (
        bytes([0x97, 0xAB]) + b"BlockStored"
        + bytes([0x91, 0xCF]) + BIG.to_bytes(8, "big")
        + bytes([0xC0]) + tokens + bytes([0x10, 0xC0, 0xA3]) + b"GPU"
    )
    payload = bytes([0x93, 0xCB]) + struct.pack(">d", 12.5) + bytes([0x91]) + ev + bytes([0x00])
    b = decode(payload)
    assert b.ts == 12.5 and b.dp_rank == 0 and b.ignored == 0
    assert b.events == (BlockStored((BIG,), None, tuple(range(16)), 16, "GPU"),)
    # msgspec writes the same object to the same bytes, so the encoded fixtures are faithful.
    assert ENC([12.5, [["BlockStored", [BIG], None, list(range(16)), 16, None, "GPU"]], 0]) == payload
    ok, stats, rstats, held = applied(payload)
    assert ok and rstats["index_blocks"] == 1 and len(held) == 1


def test_vllm_tagged_map_capture():
    # The kthena capture shape: a map event inside an array batch, unknown keys present.
    ev = stored("vllm-map", [BIG], None, list(range(16)), 16)
    ev["locality"] = "LOCAL"
    payload = ENC([1789095808.83, [ev], 0])
    b = decode(payload)
    assert b.events == (BlockStored((BIG,), None, tuple(range(16)), 16, "GPU", extra_keys=(None,), group_idx=0),)
    assert b.ts == 1789095808.83 and b.dp_rank == 0
    assert applied(payload)[0] is True


def test_map_keys_in_any_order_and_missing_optional():
    ev = {"token_ids": TOKS, "medium": "CPU", "block_hashes": [7, 8], "type": "BlockStored"}
    b = decode(ENC([0.0, [ev]]))
    assert b.events == (BlockStored((7, 8), None, tuple(TOKS), None, "CPU"),)


def test_sglang_positional_with_salt_map_and_old_removed():
    ev = stored("sglang", [-5], None, TOKS[:16], 16, "CPU_PINNED") + [{"cache_salt": "s"}]
    rm_old = ["BlockRemoved", [-5]]  # older SGLang: no medium
    b = decode(batch([ev, rm_old, removed("sglang", [3], "DISK")]))
    assert b.events == (
        BlockStored(((1 << 64) - 5,), None, tuple(TOKS[:16]), 16, "CPU_PINNED", cache_salt="s"),
        BlockRemoved(((1 << 64) - 5,), None),
        BlockRemoved((3,), "DISK"),
    )


@pytest.mark.parametrize("rank", [None, 0, 3])
def test_two_and_three_element_batches(rank):
    b = decode(batch([cleared("vllm-array")], ts=5, rank=rank))
    assert b.events == (AllBlocksCleared(),) and b.ts == 5.0 and b.dp_rank == rank


def test_trailing_batch_elements_ignored():
    b = decode(ENC([1.0, [cleared("vllm-map")], 2, "future", {"x": 1}]))
    assert b.events == (AllBlocksCleared(),) and b.dp_rank == 2


def test_map_encoded_batch():
    payload = ENC({"ts": 2.0, "events": [removed("vllm-map", [1])], "data_parallel_rank": 1, "new": 0})
    b = decode(payload)
    assert b.events == (BlockRemoved((1,), "GPU"),) and b.dp_rank == 1
    assert applied(payload)[0] is True


def test_unknown_event_types_are_counted_not_fatal():
    payload = batch([["BlockMoved", 1, 2], {"type": "Future", "x": [1]}, cleared("vllm-array")])
    b = decode(payload)
    assert b.events == (AllBlocksCleared(),) and b.ignored == 2
    ok, stats, _, _ = applied(payload)
    assert ok and stats["ignored_events"] == 2 and stats["events"] == 1


@pytest.mark.parametrize(
    "wire, expected",
    [
        (5, 5),
        (-1, (1 << 64) - 1),
        (-(1 << 63), 1 << 63),
        ((1 << 64) - 1, (1 << 64) - 1),
        (BIG, BIG),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),  # sha256 digest
        (bytes(range(16)), int.from_bytes(bytes(range(8, 16)), "big")),  # xxh3_128 digest
        (b"\x01\x02", 0x0102),
        (b"", 0),
    ],
)
def test_hash_normalization(wire, expected):
    payload = batch([stored("vllm-array", [wire], wire, TOKS[:16], 16), removed("vllm-map", [wire])])
    b = decode(payload)
    assert b.events[0].block_hashes == (expected,) and b.events[0].parent_block_hash == expected
    assert b.events[1].block_hashes == (expected,)


def test_applied_hash_forms_are_one_block():
    # The same engine block stored as uint, as signed int and as bin must be one map entry.
    h = BIG
    forms = [h, h - (1 << 64), bytes(24) + h.to_bytes(8, "big")]
    payload = batch([stored("vllm-array", [f], None, TOKS[:16], 16) for f in forms]
                    + [removed("vllm-array", [f]) for f in forms[:2]])

    def run(M):
        idx = M.PrefixIndex(1)
        a = M.EventApplier(idx)
        assert a.apply(0, payload)
        s = a.stats()
        return s["stored_blocks"], s["duplicate_stores"], s["removed_blocks"], s["unknown_removals"], idx.blocks(0)

    # One entry: stored once (twice repeated), removed once (the second removal is unknown).
    assert same(run) == ("ok", ("tuple", [1, 2, 1, 1, 0]))


# -- malformed ----------------------------------------------------------------------------------

GOOD = batch([stored("vllm-array", [1, 2], None, TOKS, 16), removed("vllm-array", [1])])

MALFORMED = [
    (b"", "payload is not valid msgpack"),
    (b"\xc1", "payload is not valid msgpack"),
    (GOOD + b"\x00", "payload is not valid msgpack"),
    (b"\xa2\xff\xfe", "payload is not valid msgpack"),  # invalid UTF-8
    (b"\x81\x80\x00", "payload is not valid msgpack"),  # unhashable map key
    (b"\xd4\x05\x00", "batch must be an array or map, got ext"),
    (ENC("x"), "batch must be an array or map, got str"),
    (ENC([1.0]), "batch array has 1 elements, expected at least 2"),
    (ENC(["t", []]), "batch ts must be a number, got str"),
    (ENC([True, []]), "batch ts must be a number, got bool"),
    (ENC({"events": []}), "batch ts must be a number, got nil"),
    (ENC([1, {"a": 1}]), "batch events must be an array, got map"),
    (ENC([1, [5]]), "event 0 must be an array or map, got int"),
    (ENC([1, [[]]]), "event 0 is an empty array"),
    (ENC([1, [[7, 1]]]), "event 0 type must be a str, got int"),
    (ENC([1, [{"block_hashes": []}]]), "event 0 type must be a str, got nil"),
    (ENC([1, [["AllBlocksCleared"], ["BlockStored", 5]]]),
     "event 1 (BlockStored) block_hashes must be an array, got int"),
    (ENC([1, [["BlockStored", [1.5], None, [], 16]]]),
     "event 0 (BlockStored) block_hashes[0] must be an int or bin, got float"),
    (ENC([1, [["BlockStored", [1], "p", TOKS[:16], 16]]]),
     "event 0 (BlockStored) parent_block_hash must be nil, an int or bin, got str"),
    (ENC([1, [["BlockStored", [1], None]]]), "event 0 (BlockStored) token_ids must be an array, got nil"),
    (ENC([1, [["BlockStored", [1], None, [1, True], 2]]]),
     "event 0 (BlockStored) token_ids[1] must be an int, got bool"),
    (ENC([1, [["BlockStored", [1], None, [1, -1], 2]]]),
     "event 0 (BlockStored) token_ids[1] = -1 is out of range [0, 2**32)"),
    (ENC([1, [["BlockStored", [1], None, [1 << 32, 0], 2]]]),
     "event 0 (BlockStored) token_ids[0] = 4294967296 is out of range [0, 2**32)"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], "16"]]]),
     "event 0 (BlockStored) block_size must be nil or an int, got str"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 0]]]),
     "event 0 (BlockStored) block_size must be positive, got 0"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], -16]]]),
     "event 0 (BlockStored) block_size must be positive, got -16"),
    (ENC([1, [["BlockStored", [1, 2], None, TOKS[:17], 16]]]),
     "event 0 (BlockStored) has 17 token_ids for 2 blocks of 16 tokens"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 1 << 40]]]),
     "event 0 (BlockStored) has 16 token_ids for 1 blocks of 1099511627776 tokens"),
    (ENC([1, [["BlockStored", [], None, TOKS[:16], 16]]]),
     "event 0 (BlockStored) has 16 token_ids for 0 blocks of 16 tokens"),
    (ENC([1, [["BlockStored", [1, 2], None, TOKS[:17]]]]),
     "event 0 (BlockStored) has 17 token_ids for 2 blocks"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 16, None, 3]]]),
     "event 0 (BlockStored) medium must be nil or a str, got int"),
    (ENC([1, [{"type": "BlockRemoved", "block_hashes": None}]]),
     "event 0 (BlockRemoved) block_hashes must be an array, got nil"),
    (ENC([1, [["BlockRemoved", [1], b"GPU"]]]),
     "event 0 (BlockRemoved) medium must be nil or a str, got bin"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 16, None, None, None, 5]]]),
     "event 0 (BlockStored) extra_keys must be nil or an array, got int"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 16, None, None, None, [7]]]]),
     "event 0 (BlockStored) extra_keys[0] must be nil or an array, got int"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 16, None, None, None, None, "0"]]]),
     "event 0 (BlockStored) group_idx must be nil or an int, got str"),
    (ENC([1, [["BlockRemoved", [1], None, 1.5]]]),
     "event 0 (BlockRemoved) group_idx must be nil or an int, got float"),
    (ENC([1, [["BlockStored", [1], None, TOKS[:16], 16, None, None, None, 5, "x"]]]),
     "event 0 (BlockStored) extra_keys must be nil or an array, got int"),
]


@pytest.mark.parametrize("payload, message", MALFORMED)
def test_malformed_payloads_are_skipped_whole(payload, message):
    with pytest.raises(MalformedBatch) as info:
        decode(payload)
    assert str(info.value) == message
    ok, stats, rstats, held = applied(payload)
    assert ok is False and stats["malformed"] == 1 and stats["last_error"] == message
    assert stats["batches"] == 0 and rstats["engine_blocks"] == 0 and held == []


def test_malformed_later_event_applies_nothing_before_it():
    payload = ENC([1, [stored("vllm-array", [1], None, TOKS[:16], 16), ["BlockRemoved", "x"]]])
    ok, stats, rstats, held = applied(payload)
    assert not ok and stats["stored_blocks"] == 0 and held == []


def test_every_truncation_is_malformed():
    for cut in range(len(GOOD)):
        assert applied(GOOD[:cut])[0] is False


def test_payload_type_errors():
    def run(M):
        a = M.EventApplier(M.PrefixIndex(1))
        return a.apply(0, "not bytes")

    assert same(run) == ("raise", ("TypeError", "payload must be a bytes-like object, got str"))

    def run_view(M):
        a = M.EventApplier(M.PrefixIndex(1))
        return a.apply(0, memoryview(GOOD)), a.apply(0, bytearray(GOOD))

    assert same(run_view)[0] == "ok"


# -- fuzz: both readers agree on anything -------------------------------------------------------

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
    st.text(max_size=6), st.binary(max_size=10),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type", "ts", "events"]),
)
_obj = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=6),
        st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids", "parent_block_hash",
                                         "block_size", "medium", "ts", "events", "x"]), kids, max_size=5),
    ),
    max_leaves=30,
)


@given(_obj)
def test_fuzz_structures_agree(obj):
    applied(ENC(obj))


@given(st.binary(max_size=40), st.integers(0, len(GOOD)), st.integers(0, 255))
def test_fuzz_bytes_agree(junk, pos, byte):
    applied(junk)
    mutated = bytearray(GOOD)
    if pos < len(mutated):
        mutated[pos] = byte
    applied(bytes(mutated))


@pytest.mark.parametrize(
    "first, second, ok",
    [
        ([True] * 16, list(range(16)), True),  # the last duplicate key wins, as in msgspec's dict
        (list(range(16)), [True] * 16, False),
        (list(range(16)), [1 << 40] * 16, False),
        (list(range(16)), list(range(1 << 20, (1 << 20) + 16)), True),
    ],
)
def test_map_event_with_duplicate_token_ids_keys(first, second, ok):
    def kv(key, value):
        return ENC(key) + ENC(value)

    event = (bytes([0x85]) + kv("type", "BlockStored") + kv("block_hashes", [1]) + kv("token_ids", first)
             + kv("token_ids", second) + kv("block_size", 16))
    payload = bytes([0x93, 0x01, 0x91]) + event + bytes([0x00])
    if ok:
        assert decode(payload).events[0].token_ids == tuple(second)
    else:
        with pytest.raises(MalformedBatch):
            decode(payload)
    got, stats, rstats, held = applied(payload)
    assert got is ok and (rstats["index_blocks"] == 1) is ok


def test_token_encodings_outside_the_fast_path():
    # uint64- and int-encoded small token ids are still token ids.
    toks = b"".join([b"\xcf" + (5).to_bytes(8, "big"), b"\xd3" + (6).to_bytes(8, "big"), b"\xd0\x07"]
                    + [bytes([i]) for i in range(13)])
    for layout in ("array", "map"):
        if layout == "array":
            event = bytes([0x95]) + ENC("BlockStored") + ENC([9]) + b"\xc0" + b"\xdc\x00\x10" + toks + ENC(16)
        else:
            event = (bytes([0x84]) + ENC("type") + ENC("BlockStored") + ENC("block_hashes") + ENC([9])
                     + ENC("token_ids") + b"\xdc\x00\x10" + toks + ENC("block_size") + ENC(16))
        payload = bytes([0x92, 0x01, 0x91]) + event
        assert decode(payload).events[0].token_ids == (5, 6, 7, *range(13))
        assert applied(payload)[0] is True
