"""Chained block hashing: XXH3-64 against the xxhash package, block_hashes against a naive
chain written from the README formula, and native against reference for every input kind
and every bad input (tests/common.py `same`)."""

from __future__ import annotations

import array
import random
import struct
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from common import same
from conftest import IMPLEMENTATIONS, load_impl

# Hypothesis tests take the implementation's name rather than the function-scoped `impl`
# fixture, which hypothesis would not reset between examples.
each_impl = pytest.mark.parametrize("impl_name", IMPLEMENTATIONS)

U64 = (1 << 64) - 1

# Lengths on each side of every branch of XXH3-64: 0, 1-3, 4-8, 9-16, 17-128 (by 32-byte
# rounds), 129-240, and the long path around a stripe (64), a block (1024) and its last
# partial stripe.
BOUNDARY_LENGTHS = sorted(
    {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128}
    | {129, 143, 144, 145, 239, 240, 241, 255, 256, 257, 1023, 1024, 1025, 1087, 1088, 1089}
    | {2047, 2048, 2049, 4096 + 65, 10_000}
)


def naive_chain(tokens: list[int], block_size: int, salt: bytes = b"") -> list[int]:
    """The README formula, spelled out with struct and the xxhash package."""
    seed = xxhash.xxh3_64_intdigest(salt, 0)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        seed = xxhash.xxh3_64_intdigest(block, seed)
        out.append(seed)
    return out


# --- XXH3-64 ---------------------------------------------------------------------------


def test_xxh3_every_length_to_1100(impl):
    rng = random.Random(20261129)
    data = rng.randbytes(1100)
    for length in range(1101):
        chunk = data[:length]
        for seed in (0, rng.getrandbits(64), U64):
            want = xxhash.xxh3_64_intdigest(chunk, seed)
            assert impl.xxh3_64(chunk, seed) == want, (length, seed)


@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_xxh3_length_classes(impl, length):
    rng = random.Random(length)
    for _ in range(20):
        data = rng.randbytes(length)
        seed = rng.choice([0, 1, U64, rng.getrandbits(64), rng.getrandbits(32)])
        assert impl.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (length, seed)


@each_impl
@given(data=st.binary(max_size=1100), seed=st.integers(0, U64))
def test_xxh3_random(impl_name, data, seed):
    impl = load_impl(impl_name)
    assert impl.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


def test_xxh3_default_seed_is_zero(impl):
    assert impl.xxh3_64(b"kvroute") == xxhash.xxh3_64_intdigest(b"kvroute", 0)


def test_xxh3_buffer_kinds(impl):
    raw = bytes(range(256)) * 3
    arr = np.frombuffer(raw, dtype=np.uint32)
    want = xxhash.xxh3_64_intdigest(raw, 7)
    assert impl.xxh3_64(bytearray(raw), 7) == want
    assert impl.xxh3_64(memoryview(raw), 7) == want
    assert impl.xxh3_64(arr, 7) == want
    assert impl.xxh3_64(array.array("B", raw), 7) == want
    # A strided buffer hashes the bytes it would have in C order.
    strided = np.arange(300, dtype=np.int64)[::3]
    assert impl.xxh3_64(strided, 7) == xxhash.xxh3_64_intdigest(strided.tobytes(), 7)
    assert impl.xxh3_64(np.asfortranarray(np.arange(12).reshape(3, 4)), 1) == xxhash.xxh3_64_intdigest(
        np.arange(12).reshape(3, 4).tobytes(), 1
    )


@pytest.mark.parametrize(
    "data, seed",
    [
        ("text", 0),
        (5, 0),
        (None, 0),
        ([1, 2], 0),
        (b"x", -1),
        (b"x", 1 << 64),
        (b"x", 1.0),
        (b"x", True),
        (b"x", np.bool_(False)),
        (b"x", "1"),
        (b"x", None),
        ("text", -1),  # the data error is reported first
    ],
)
def test_xxh3_bad_input(data, seed):
    kind, _ = same(lambda m: m.xxh3_64(data, seed))
    assert kind == "raise"


def test_xxh3_numpy_integer_seed():
    assert same(lambda m: m.xxh3_64(b"abc", np.uint64(U64))) == ("ok", xxhash.xxh3_64_intdigest(b"abc", U64))


# --- block_hashes ----------------------------------------------------------------------


@each_impl
@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), max_size=700),
    block_size=st.integers(1, 600),
    salt=st.one_of(st.none(), st.text(max_size=20), st.binary(max_size=20)),
)
def test_block_hashes_matches_naive_chain(impl_name, tokens, block_size, salt):
    impl = load_impl(impl_name)
    salt_raw = b"" if salt is None else salt.encode() if isinstance(salt, str) else salt
    got = impl.block_hashes(np.array(tokens, dtype=np.uint32), block_size, salt=salt)
    assert got.dtype == np.uint64 and got.ndim == 1
    assert got.tolist() == naive_chain(tokens, block_size, salt_raw)


@given(
    seed=st.integers(0, 2**32 - 1),
    n_tokens=st.integers(0, 2000),
    block_size=st.integers(1, 600),
    salt=st.sampled_from([None, "", "llama-3-8b", "模型/лора", b"\x00\xff", "e\u0301"]),
)
def test_block_hashes_native_equals_reference(seed, n_tokens, block_size, salt):
    tokens = np.random.default_rng(seed).integers(0, 1 << 32, n_tokens, dtype=np.uint64)
    same(lambda m: m.block_hashes(tokens, block_size, salt=salt))


def test_block_hashes_default_block_size_is_16(impl):
    tokens = list(range(100))
    assert impl.block_hashes(tokens).tolist() == naive_chain(tokens, 16)


def test_block_hashes_large_block_sizes(impl):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1 << 32, 70_000, dtype=np.uint32)
    for block_size in (61, 64, 65, 240, 241, 256, 257, 1000, 65536):
        got = impl.block_hashes(tokens, block_size)
        assert got.tolist() == naive_chain(tokens[: len(got) * block_size].tolist(), block_size)


ACCEPTED_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


def _token_values(dtype: str, n: int, seed: int) -> np.ndarray:
    info = np.iinfo(dtype)
    high = min(int(info.max), (1 << 32) - 1)
    return np.random.default_rng(seed).integers(0, high, n, endpoint=True, dtype=np.uint64)


@pytest.mark.parametrize("dtype", ACCEPTED_DTYPES)
@pytest.mark.parametrize("byteorder", ["<", ">"])
def test_every_integer_dtype_and_byte_order(impl, dtype, byteorder):
    values = _token_values(dtype, 333, seed=len(dtype))
    arr = values.astype(np.dtype(dtype).newbyteorder(byteorder))
    want = naive_chain(values.tolist(), 16, b"s")
    assert impl.block_hashes(arr, 16, salt=b"s").tolist() == want
    assert impl.block_hashes(arr[::1].copy(), 16, salt="s").tolist() == want


@pytest.mark.parametrize("dtype", ACCEPTED_DTYPES)
def test_non_contiguous_arrays(impl, dtype):
    values = _token_values(dtype, 400, seed=7)
    base = values.astype(dtype)
    for view in (base[::2], base[1::3], base[::-1], np.stack([base, base], axis=1)[:, 1]):
        assert not view.flags.c_contiguous
        assert impl.block_hashes(view, 8).tolist() == naive_chain(view.astype(np.uint64).tolist(), 8)


def test_python_sequences_and_array_array(impl):
    values = _token_values("uint32", 100, seed=1).tolist()
    want = naive_chain(values, 10)
    assert impl.block_hashes(values, 10).tolist() == want
    assert impl.block_hashes(tuple(values), 10).tolist() == want
    assert impl.block_hashes([np.uint32(v) for v in values], 10).tolist() == want
    for typecode in "IlLqQ":
        assert impl.block_hashes(array.array(typecode, values), 10).tolist() == want
    small = [v % 100 for v in values]
    for typecode in "bBhHi":
        assert impl.block_hashes(array.array(typecode, small), 10).tolist() == naive_chain(small, 10)


def test_fewer_tokens_than_a_block_give_an_empty_array(impl):
    for tokens in ([], [1, 2, 3], np.zeros(15, np.int32), array.array("i", [1] * 15), ()):
        got = impl.block_hashes(tokens, 16)
        assert got.dtype == np.uint64 and got.shape == (0,)


def test_trailing_partial_block_is_ignored(impl):
    tokens = list(range(50))
    assert impl.block_hashes(tokens, 16).tolist() == impl.block_hashes(tokens[:48], 16).tolist()


def test_token_range_edges(impl):
    tokens = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
    assert impl.block_hashes(tokens, 1).tolist() == naive_chain(tokens, 1)
    arr = np.array(tokens, dtype=np.int64)
    assert impl.block_hashes(arr, 1).tolist() == naive_chain(tokens, 1)


def test_salt_namespaces_the_chain(impl):
    tokens = list(range(64))
    plain = impl.block_hashes(tokens)
    assert impl.block_hashes(tokens, salt=None).tolist() == plain.tolist()
    assert impl.block_hashes(tokens, salt="").tolist() == plain.tolist()
    assert impl.block_hashes(tokens, salt="é").tolist() == impl.block_hashes(tokens, salt="é".encode()).tolist()
    assert impl.block_hashes(tokens, salt=bytearray(b"ab")).tolist() == impl.block_hashes(tokens, salt=b"ab").tolist()
    assert impl.block_hashes(tokens, salt=memoryview(b"ab")).tolist() == impl.block_hashes(tokens, salt=b"ab").tolist()
    assert set(impl.block_hashes(tokens, salt="a").tolist()).isdisjoint(plain.tolist())


@each_impl
@given(
    prefix=st.lists(st.integers(0, (1 << 32) - 1), max_size=200),
    tail_a=st.lists(st.integers(0, (1 << 32) - 1), max_size=100),
    tail_b=st.lists(st.integers(0, (1 << 32) - 1), max_size=100),
    block_size=st.integers(1, 40),
)
def test_prefix_property(impl_name, prefix, tail_a, tail_b, block_size):
    impl = load_impl(impl_name)
    a, b = prefix + tail_a, prefix + tail_b
    ha, hb = impl.block_hashes(a, block_size).tolist(), impl.block_hashes(b, block_size).tolist()
    # The first block where the two token lists differ, counted in full blocks of both.
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    shared = min(first_diff // block_size, len(ha), len(hb))
    assert ha[:shared] == hb[:shared]
    # From the first differing full block on, every hash differs (a collision would be a bug
    # at these sizes: 2**-64 per pair).
    for i in range(shared, min(len(ha), len(hb))):
        assert ha[i] != hb[i], (i, shared)


BAD_TOKENS = [
    pytest.param([1, -1], id="negative-in-list"),
    pytest.param([1, 1 << 32], id="too-big-in-list"),
    pytest.param((0, 1 << 70), id="huge-in-tuple"),
    pytest.param([1, True], id="bool-in-list"),
    pytest.param([1, np.bool_(True)], id="numpy-bool-in-list"),
    pytest.param([1, 2.0], id="float-in-list"),
    pytest.param([1, "2"], id="str-in-list"),
    pytest.param([1, None], id="none-in-list"),
    pytest.param([[1, 2]], id="nested-list"),
    pytest.param(np.array([3, -7, -8], dtype=np.int32), id="negative-int32"),
    pytest.param(np.array([3, 4, -9], dtype=np.int8), id="negative-int8"),
    pytest.param(np.array([3, -9], dtype=">i2"), id="negative-big-endian-int16"),
    pytest.param(np.array([1, -(1 << 40)], dtype=np.int64), id="negative-int64"),
    pytest.param(np.array([1, 1 << 40, 5], dtype=np.int64), id="too-big-int64"),
    pytest.param(np.array([1, 1 << 63], dtype=np.uint64), id="too-big-uint64"),
    pytest.param(np.array([1, 1 << 33], dtype=">u8"), id="too-big-big-endian-uint64"),
    pytest.param(np.arange(-10, 10, dtype=np.int32)[::-1], id="negative-strided"),
    pytest.param(np.array([1.0, 2.0]), id="float64"),
    pytest.param(np.array([1, 2], dtype=np.float16), id="float16"),
    pytest.param(np.array([True, False]), id="bool-array"),
    pytest.param(np.array([1, 2], dtype=object), id="object-array"),
    pytest.param(np.array(["1"]), id="str-array"),
    pytest.param(np.array([1 + 2j]), id="complex-array"),
    pytest.param(np.array([1], dtype="datetime64[s]"), id="datetime-array"),
    pytest.param(np.zeros((2, 16), dtype=np.int32), id="2-d"),
    pytest.param(np.zeros((2, 2), dtype=np.float32), id="2-d-float"),
    pytest.param(np.array(5, dtype=np.int32), id="0-d"),
    pytest.param(np.int32(5), id="numpy-scalar"),
    pytest.param(array.array("f", [1.0]), id="array-float"),
    pytest.param(array.array("d", [1.0]), id="array-double"),
    pytest.param(array.array("u", "ab"), id="array-unicode"),
    pytest.param(array.array("q", [5, -3]), id="array-negative"),
    pytest.param("abc", id="str"),
    pytest.param(b"abc", id="bytes"),
    pytest.param(range(20), id="range"),
    pytest.param(iter([1, 2]), id="iterator"),
    pytest.param(None, id="none"),
    pytest.param(17, id="int"),
    pytest.param({1: 2}, id="dict"),
]


@pytest.mark.parametrize("tokens", BAD_TOKENS)
def test_bad_tokens(tokens):
    kind, (exc_type, message) = same(lambda m: m.block_hashes(tokens, 1))
    assert kind == "raise"
    assert exc_type in ("TypeError", "ValueError"), message
    assert "token" in message


def test_bad_token_message_names_value_and_index():
    assert same(lambda m: m.block_hashes(np.array([0, 5, -3, -4], np.int64), 2)) == (
        "raise",
        ("ValueError", "token -3 at index 2 is out of range [0, 2**32)"),
    )
    assert same(lambda m: m.block_hashes([7] * 99 + [1 << 32], 2)) == (
        "raise",
        ("ValueError", "token 4294967296 at index 99 is out of range [0, 2**32)"),
    )


@pytest.mark.parametrize(
    "block_size",
    [0, -1, 65537, 1 << 64, 1 << 200, True, np.bool_(True), 1.0, 16.0, "16", None, np.float64(2)],
)
def test_bad_block_size(block_size):
    kind, (exc_type, message) = same(lambda m: m.block_hashes([1] * 32, block_size))
    assert kind == "raise" and exc_type in ("TypeError", "ValueError")
    assert "block_size" in message


def test_block_size_accepts_integer_likes(impl):
    tokens = list(range(64))
    want = naive_chain(tokens, 16)
    assert impl.block_hashes(tokens, np.int64(16)).tolist() == want
    assert impl.block_hashes(tokens, np.uint8(16)).tolist() == want
    assert impl.block_hashes(tokens, block_size=16).tolist() == want


@pytest.mark.parametrize("salt", [1, 1.5, ["a"], ("a",), object(), "\ud800", np.array([1], np.uint8)])
def test_bad_salt(salt):
    kind, _ = same(lambda m: m.block_hashes([1] * 32, 16, salt=salt))
    assert kind == "raise"


def test_checks_run_in_reference_order():
    # block_size, then tokens, then salt: the first problem is the one reported.
    assert same(lambda m: m.block_hashes([-1], 0, salt=1))[1][1].startswith("block_size")
    assert same(lambda m: m.block_hashes([-1], 1, salt=1))[1][1].startswith("token")
    assert same(lambda m: m.block_hashes([1], 1, salt=1))[1][1].startswith("salt")


def test_salt_is_keyword_only(impl):
    with pytest.raises(TypeError):
        impl.block_hashes([1] * 16, 16, "salt")


def test_input_array_is_not_modified(impl):
    for dtype in ("int32", ">u4", "int64"):
        arr = np.arange(64).astype(dtype)
        before = arr.copy()
        impl.block_hashes(arr, 16)
        assert arr.tolist() == before.tolist() and arr.dtype == before.dtype


@pytest.mark.usefixtures("gil_released")
def test_threads_hash_concurrently(impl):
    # With the GIL released (gil_released), concurrent native calls must not interfere.
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 50_000, 4096, dtype=np.int32) for _ in range(8)]
    want = [impl.block_hashes(p, 16).tolist() for p in prompts]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = impl.block_hashes(prompts[i], 16).tolist()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == want


@pytest.mark.parametrize("block_size", [1, 7, 16, 17, 100])
@pytest.mark.parametrize("where", [0, 15, 16, 500, 1023, 1029])
def test_negative_int32_anywhere(block_size, where):
    # int32 input is sign-checked inside the hashing pass; a negative token in a hashed block
    # or in the unhashed tail must fail the same way as in the reference.
    tokens = np.arange(1030, dtype=np.int32)
    tokens[where] = -where - 1
    assert same(lambda m: m.block_hashes(tokens, block_size)) == (
        "raise",
        ("ValueError", f"token {-where - 1} at index {where} is out of range [0, 2**32)"),
    )
    assert same(lambda m: m.block_hashes(tokens, block_size, salt=3))[1][1].startswith("token")


@pytest.mark.parametrize("dtype", ["int64", "uint64", ">i8"])
@pytest.mark.parametrize("block_size", [1, 3, 16, 2047, 2048, 3000])
def test_64_bit_arrays_across_chunks(impl, dtype, block_size):
    # Native hashes 64-bit arrays in place, narrowing a chunk of about 2048 tokens at a time.
    values = _token_values("uint32", 7001, seed=block_size)
    got = impl.block_hashes(values.astype(dtype), block_size, salt="x")
    assert got.tolist() == naive_chain(values.tolist(), block_size, b"x")


@pytest.mark.parametrize("dtype", ["int64", "uint64"])
@pytest.mark.parametrize("block_size", [1, 16, 2048, 3000])
@pytest.mark.parametrize("where", [0, 2047, 2048, 4095, 6999, 7000])
def test_bad_64_bit_token_anywhere(dtype, block_size, where):
    # In a hashed block, in a later chunk or in the unhashed tail: the same error as the reference.
    tokens = np.arange(7001, dtype=dtype)
    bad = -(where + 1) if dtype == "int64" else (1 << 32) + where
    tokens[where] = bad
    assert same(lambda m: m.block_hashes(tokens, block_size)) == (
        "raise",
        ("ValueError", f"token {bad} at index {where} is out of range [0, 2**32)"),
    )
    assert same(lambda m: m.block_hashes(tokens, block_size, salt=1.5))[1][1].startswith("token")
