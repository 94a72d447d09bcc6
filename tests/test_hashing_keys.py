"""Per-request cache keys in block_hashes (contract C1: lora, cache_salt, mm), against a
naive chain written from the README's "Block hashing" section, on both implementations."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from common import same
from conftest import IMPLEMENTATIONS, load_impl

each_impl = pytest.mark.parametrize("impl_name", IMPLEMENTATIONS)


def naive_keyed(tokens, bs, salt=b"", lora=None, cache_salt=None, mm=()):
    """The README formula with keys, spelled out with struct and xxhash."""
    seed = xxhash.xxh3_64_intdigest(salt, 0)
    k = b""
    if lora:
        raw = lora.encode()
        k += b"L" + struct.pack("<I", len(raw)) + raw
    if cache_salt:
        raw = cache_salt.encode()
        k += b"C" + struct.pack("<I", len(raw)) + raw
    if k:
        seed = xxhash.xxh3_64_intdigest(k, seed)
    order = sorted(range(len(mm)), key=lambda i: (mm[i][1], i))
    out = []
    for b in range(len(tokens) // bs):
        payload = struct.pack(f"<{bs}I", *tokens[b * bs : (b + 1) * bs])
        for i in order:
            ident, off, _ = mm[i]
            if b * bs <= off < (b + 1) * bs:
                raw = ident.encode()
                payload += b"M" + struct.pack("<I", len(raw)) + raw + struct.pack("<Q", off)
        seed = xxhash.xxh3_64_intdigest(payload, seed)
        out.append(seed)
    return out


mm_strategy = st.lists(
    st.tuples(st.text(max_size=6), st.integers(0, 80), st.integers(1, 40)), max_size=4
)


@each_impl
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    bs=st.sampled_from([1, 3, 16]),
    lora=st.none() | st.text(max_size=5),
    cache_salt=st.none() | st.text(max_size=5),
    mm=mm_strategy,
)
def test_keyed_chain_matches_readme(impl_name, tokens, bs, lora, cache_salt, mm):
    impl = load_impl(impl_name)
    got = impl.block_hashes(tokens, bs, salt="s", lora=lora, cache_salt=cache_salt, mm=mm)
    assert got.dtype == np.uint64
    assert got.tolist() == naive_keyed(tokens, bs, b"s", lora, cache_salt, mm)


def test_no_keys_is_todays_chain(impl):
    tokens = list(range(100))
    plain = impl.block_hashes(tokens, 16, salt="m").tolist()
    assert impl.block_hashes(tokens, 16, salt="m", lora=None, cache_salt=None, mm=None).tolist() == plain
    assert impl.block_hashes(tokens, 16, salt="m", lora="", cache_salt="", mm=[]).tolist() == plain


def test_keys_partition_prompts(impl):
    tokens = np.arange(64, dtype=np.int64)
    base = impl.block_hashes(tokens, 16).tolist()
    lora = impl.block_hashes(tokens, 16, lora="a").tolist()
    salted = impl.block_hashes(tokens, 16, cache_salt="a").tolist()
    # Every block differs (the chain differs from block 0 on); 'L' and 'C' do not collide.
    assert all(x != y for x, y in zip(base, lora))
    assert all(x != y for x, y in zip(lora, salted))
    # An image at offset 20 leaves block 0 alone and changes every block from block 1 on.
    img = impl.block_hashes(tokens, 16, mm=[("img-1", 20, 30)]).tolist()
    other = impl.block_hashes(tokens, 16, mm=[("img-2", 20, 30)]).tolist()
    assert img[0] == base[0] and all(x != y for x, y in zip(img[1:], base[1:]))
    assert img[0] == other[0] and all(x != y for x, y in zip(img[1:], other[1:]))


def test_every_token_input_kind_agrees_with_keys(impl):
    tokens = list(range(40))
    want = impl.block_hashes(tokens, 8, lora="x", mm=[("i", 9, 3)]).tolist()
    for kind in (np.int32, np.uint32, np.int64, np.uint64, np.int16):
        got = impl.block_hashes(np.array(tokens, dtype=kind), 8, lora="x", mm=[("i", 9, 3)])
        assert got.tolist() == want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lora": 3},
        {"cache_salt": b"x"},
        {"mm": "abc"},
        {"mm": [("a", 1)]},
        {"mm": [3]},
        {"mm": [(1, 0, 1)]},
        {"mm": [("a", -1, 1)]},
        {"mm": [("a", 0, 0)]},
        {"mm": [("a", 1.0, 1)]},
        {"mm": [("a", True, 1)]},
        {"mm": [("a", 2**63, 1)]},
        {"mm": [("a", 0, "1")]},
        {"lora": "\ud800"},
        {"mm": [("\udfff", 0, 1)]},
    ],
)
def test_bad_keys_same_error(kwargs):
    kind, (name, _) = same(lambda m: m.block_hashes([1, 2, 3, 4], 2, **kwargs))
    assert kind == "raise" and name in ("TypeError", "ValueError", "UnicodeEncodeError")


def test_bad_token_outranks_bad_key():
    kind, (name, message) = same(lambda m: m.block_hashes([1, -1], 2, lora=5))
    assert (kind, name) == ("raise", "ValueError") and "token -1" in message
