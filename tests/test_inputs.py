"""Hostile and unusual argument objects (issue 11 items 6, 11, 12, 13; issue 10 section 6).

Every scenario runs on both implementations through `same()`: identical results, or the same
exception type and message. The conversion code is cpp/bindings/{pyargs.hpp,tokens.cpp,
hashes.cpp} and its twin python/kvroute/reference/args.py (+ hashing.py, index.py).
"""

from __future__ import annotations

import array
import json

import numpy as np
import pytest

from common import same
from kvroute.config import RouterConfig

TOKENS = list(range(100, 164))  # four blocks of 16
SURROGATE_TEXTS = [json.loads('"\\ud800"'), "ok" + json.loads('"\\udc80"') + "x", "a\ud83dz"]


def plain(value):
    """Undo common._normalize: lists and tuples back to lists, arrays to lists of values."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("list", "tuple"):
        return [plain(v) for v in value[1]]
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "ndarray":
        return value[3]
    return value


def outcome(fn):
    """same(fn), with the result made plain."""
    kind, got = same(fn)
    return kind, plain(got)


def _router(M, names=("a", "b")):
    return M.Router(RouterConfig(policy="ttft", block_size=16), list(names))


def _state(router):
    stats = router.stats()
    return stats, router.replicas, [router.load(n) for n in router.replicas]


# --- item 6: lone surrogates -------------------------------------------------------------


@pytest.mark.parametrize("text", SURROGATE_TEXTS)
def test_lone_surrogate_session_is_a_clear_value_error(text):
    def scenario(M):
        r = _router(M)
        before = _state(r)
        out = []
        for call in (lambda: r.route(TOKENS, session=text), lambda: r.route_hashes([1, 2], 32, session=text)):
            try:
                call()
            except ValueError as exc:
                out.append((type(exc).__name__, str(exc)))
        assert _state(r) == before  # refused before anything was reserved
        return out

    kind, out = outcome(scenario)
    where = SURROGATE_TEXTS.index(text)
    index = [0, 2, 1][where]
    assert out == [["ValueError", f"session must be encodable as UTF-8, got a lone surrogate at index {index}"]] * 2


@pytest.mark.parametrize(
    "call",
    [
        lambda r, n: r.add_replica(n),
        lambda r, n: r.replica_id(n),
        lambda r, n: r.remove_replica(n),
        lambda r, n: r.drain(n),
        lambda r, n: r.set_healthy(n, False),
        lambda r, n: r.report_load(n, waiting=1),
        lambda r, n: r.load(n),
    ],
    ids=["add_replica", "replica_id", "remove_replica", "drain", "set_healthy", "report_load", "load"],
)
def test_lone_surrogate_replica_name(call):
    def scenario(M):
        r = _router(M)
        before = _state(r)
        try:
            call(r, "r\udfff")
        finally:
            assert _state(r) == before

    assert same(scenario) == (
        "raise",
        ("ValueError", "replica name must be encodable as UTF-8, got a lone surrogate at index 1"),
    )


def test_lone_surrogate_in_the_replica_list_and_salt():
    assert same(lambda M: _router(M, ["a", "\ud800"])) == (
        "raise",
        ("ValueError", "replica name must be encodable as UTF-8, got a lone surrogate at index 0"),
    )
    salt_error = ("ValueError", "salt must be encodable as UTF-8, got a lone surrogate at index 3")
    assert same(lambda M: M.block_hashes(TOKENS, 16, salt="abc\udc00")) == ("raise", salt_error)
    with pytest.raises(ValueError, match="salt must be encodable as UTF-8"):
        RouterConfig(salt="abc\udc00")


def test_lone_surrogate_medium():
    def scenario(M, removed):
        idx = M.PrefixIndex(1)
        a = M.EventApplier(idx)
        try:
            if removed:
                a.apply_removed(0, [1], medium="GPU\ud800")
            else:
                a.apply_stored(0, [1], None, TOKENS[:16], medium="GPU\ud800")
        finally:
            assert idx.num_blocks == 0 and a.stats() == M.EventApplier(M.PrefixIndex(1)).stats()

    error = ("ValueError", "medium must be encodable as UTF-8, got a lone surrogate at index 3")
    assert same(lambda M: scenario(M, False)) == ("raise", error)
    assert same(lambda M: scenario(M, True)) == ("raise", error)


def test_text_outside_the_bmp_and_accents_is_fine():
    # A proper surrogate *pair* in JSON is one code point, which UTF-8 encodes.
    session = json.loads('"caf\\u00e9-\\ud83d\\ude00"')
    name = "r\u00e9plica-\U0001f600"

    def scenario(M):
        r = _router(M, [name, "b"])
        d = r.route(TOKENS, session=session)
        again = r.route(TOKENS, session=session)
        return d.replica, again.replica, again.binding, r.replica_id(name)

    kind, (first, second, binding, rid) = outcome(scenario)
    assert first == second and binding == "kept" and rid == 0


# --- item 11: numpy masked arrays ----------------------------------------------------------


def test_masked_arrays_are_refused():
    tokens = np.ma.array(TOKENS, mask=[i == 5 for i in range(64)], dtype=np.int64)
    hashes = np.ma.array([1, 2, 3], mask=[False, True, False], dtype=np.uint64)
    tok_error = (
        "TypeError",
        "tokens must not be a numpy masked array (its mask cannot be honoured); pass .compressed() or .filled(value)",
    )
    hash_error = (tok_error[0], tok_error[1].replace("tokens", "hashes", 1))
    assert same(lambda M: M.block_hashes(tokens, 16)) == ("raise", tok_error)
    assert same(lambda M: _router(M).route(tokens)) == ("raise", tok_error)
    assert same(lambda M: _router(M).route_hashes(hashes, 48)) == ("raise", hash_error)
    for op in ("insert", "remove", "touch"):
        def scenario(M, op=op):
            ix = M.PrefixIndex(1)
            try:
                getattr(ix, op)(0, hashes)
            finally:
                assert ix.num_blocks == 0

        assert same(scenario) == ("raise", hash_error)
    assert same(lambda M: M.PrefixIndex(1).match(hashes)) == ("raise", hash_error)
    # Unmasked data in a plain array is of course accepted.
    assert same(lambda M: M.block_hashes(tokens.filled(0), 16))[0] == "ok"


# --- item 12: a list that changes while it is converted ------------------------------------


class Mutating:
    """An int-like whose __index__ empties (or grows) the list it sits in."""

    def __init__(self, value, victim, grow=False):
        self.value, self.victim, self.grow = value, victim, grow

    def __index__(self):
        if self.grow:
            self.victim.extend(range(1000, 1040))
        else:
            del self.victim[1:]
        return self.value


@pytest.mark.parametrize("at", [0, 3, 40])
@pytest.mark.parametrize("grow", [False, True], ids=["shrink", "grow"])
def test_list_changed_during_token_conversion_reads_the_list_as_passed(at, grow):
    def scenario(M):
        tokens = list(TOKENS)
        tokens[at] = Mutating(TOKENS[at], tokens, grow)
        return M.block_hashes(tokens, 16)

    kind, got = same(scenario)
    assert kind == "ok"
    from kvroute.reference import block_hashes

    assert got == ("ndarray", "uint64", (4,), block_hashes(TOKENS, 16).tolist())


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("grow", [False, True], ids=["shrink", "grow"])
def test_list_changed_during_hash_conversion_reads_the_list_as_passed(at, grow):
    chain = [11, 12, 13, 14, 15]

    def scenario(M):
        hashes = list(chain)
        hashes[at] = Mutating(chain[at], hashes, grow)
        ix = M.PrefixIndex(2)
        stored = ix.insert(0, hashes)
        return stored, ix.held(0), ix.match(chain)

    kind, got = outcome(scenario)
    assert kind == "ok" and got[0] == 5
    assert sorted(got[1]) == chain and got[2] == [5, 0]


# --- item 13: misaligned arrays ------------------------------------------------------------


def _misaligned(values, dtype):
    """values as a C-contiguous array of dtype whose data pointer is off by one byte."""
    dtype = np.dtype(dtype)
    raw = np.zeros(len(values) * dtype.itemsize + 1, np.uint8)[1:]
    out = raw.view(dtype)
    out[:] = values
    assert (not out.flags.aligned or not len(values)) and out.flags.c_contiguous
    return out


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64, np.uint64, np.int16])
def test_misaligned_tokens_hash_like_aligned_ones(impl, dtype):
    want = impl.block_hashes(np.array(TOKENS, dtype=dtype), 16).tolist()
    assert impl.block_hashes(_misaligned(TOKENS, dtype), 16).tolist() == want
    r = _router(impl)
    assert r.route(_misaligned(TOKENS, dtype)).prompt_tokens == 64
    if dtype is not np.uint32:  # uint32 cannot hold a bad token
        bad = list(TOKENS)
        bad[7] = (1 << 32) + 1 if dtype is np.uint64 else -1
        assert same(lambda M: M.block_hashes(_misaligned(bad, dtype), 16)) == (
            "raise",
            ("ValueError", f"token {bad[7]} at index 7 is out of range [0, 2**32)"),
        )


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_misaligned_hashes_match_like_aligned_ones(dtype):
    chain = [3, 5, 7, 9]

    def scenario(M):
        ix = M.PrefixIndex(2)
        ix.insert(1, _misaligned(chain, dtype))
        return ix.match(_misaligned(chain[:3] + [99], dtype)), ix.held(1)

    kind, got = outcome(scenario)
    assert kind == "ok" and got[0] == [0, 3]


# --- issue 10 section 6: any integer buffer --------------------------------------------------


def _buffers(values):
    arr = np.array(values, dtype=np.uint64)
    return {
        "array-Q": array.array("Q", values),
        "array-q": array.array("q", [v - (1 << 64) if v >= 1 << 63 else v for v in values]),
        "memoryview-ndarray": memoryview(arr),
        "memoryview-cast": memoryview(arr.tobytes()).cast("Q"),
        "memoryview-strided": memoryview(np.repeat(arr, 2))[::2],
        "memoryview-L": memoryview(array.array("L", values)),
        "memoryview-I": memoryview(np.array(values, dtype=np.uint32)) if max(values) < 1 << 32 else None,
    }


@pytest.mark.parametrize("kind", list(_buffers([1])))
def test_hash_buffers_are_accepted(kind):
    chain = [7, (1 << 64) - 3, 9, 1 << 40] if kind != "memoryview-I" else [7, 8, 9, 10]

    def scenario(M):
        ix = M.PrefixIndex(2)
        ix.insert(0, _buffers(chain)[kind])
        r = _router(M)
        d = r.route_hashes(_buffers(chain)[kind], 64)
        return ix.match(_buffers(chain)[kind]), ix.held(0), d.prompt_tokens

    kind_, got = outcome(scenario)
    assert kind_ == "ok" and got[0] == [4, 0] and sorted(got[1]) == sorted(chain) and got[2] == 64


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(memoryview(np.array([1.5])), id="memoryview-float"),
        pytest.param(memoryview(np.zeros((2, 2), np.uint64)), id="memoryview-2d"),
        pytest.param(b"\x00" * 16, id="bytes"),
        pytest.param(bytearray(16), id="bytearray"),
        pytest.param(np.uint64(5), id="numpy-scalar"),
        pytest.param(memoryview(array.array("d", [1.0])), id="memoryview-double"),
    ],
)
def test_bad_buffers_read_the_same(value):
    kind, got = same(lambda M: M.PrefixIndex(1).match(value))
    assert kind == "raise"
    kind, got = same(lambda M: M.block_hashes(value, 1))
    assert kind == "raise"


def test_token_buffers_are_accepted(impl):
    want = impl.block_hashes(TOKENS, 16).tolist()
    for buf in (
        memoryview(np.array(TOKENS, np.int32)),
        memoryview(array.array("H", TOKENS)),
        memoryview(np.repeat(np.array(TOKENS, np.uint64), 3))[::3],
    ):
        assert impl.block_hashes(buf, 16).tolist() == want
    assert same(lambda M: M.block_hashes(memoryview(np.array([1, -2], np.int8)), 1)) == (
        "raise",
        ("ValueError", "token -2 at index 1 is out of range [0, 2**32)"),
    )


def test_lone_surrogate_request_keys():
    cases = [
        (dict(lora="ad\ud800"), "lora must be encodable as UTF-8, got a lone surrogate at index 2"),
        (dict(cache_salt="\udc00s"), "cache_salt must be encodable as UTF-8, got a lone surrogate at index 0"),
        (dict(mm=[("img", 0, 4), ("x\ud800", 16, 4)]),
         "mm[1] identifier must be encodable as UTF-8, got a lone surrogate at index 1"),
    ]
    for keys, message in cases:
        assert same(lambda M: M.block_hashes(TOKENS, 16, **keys)) == ("raise", ("ValueError", message))


# --- every form of the same values converts alike ----------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FORMS = {
    "list": lambda v, dt: list(v),
    "tuple": lambda v, dt: tuple(v),
    "numpy": lambda v, dt: np.array(v, dtype=dt),
    "numpy-strided": lambda v, dt: np.repeat(np.array(v, dtype=dt), 2)[::2],
    "numpy-swapped": lambda v, dt: np.array(v, dtype=np.dtype(dt).newbyteorder()),
    "misaligned": lambda v, dt: _misaligned(v, dt),
    "array.array": lambda v, dt: array.array(np.dtype(dt).char, v),
    "memoryview": lambda v, dt: memoryview(np.array(v, dtype=dt)),
}


@given(
    values=st.lists(st.integers(0, 60_000), max_size=80),
    dtype=st.sampled_from(["int32", "uint32", "int64", "uint64", "uint16"]),
    form=st.sampled_from(sorted(FORMS)),
)
def test_every_form_of_the_same_tokens_and_hashes_agrees(values, dtype, form):
    want_tokens = load_reference().block_hashes(values, 4).tolist()
    kind, got = outcome(lambda M: M.block_hashes(FORMS[form](values, dtype), 4))
    assert kind == "ok" and got == want_tokens
    chain = sorted(set(values))
    if not chain:
        return

    def scenario(M):
        ix = M.PrefixIndex(2)
        ix.insert(1, FORMS[form](chain, dtype))
        return ix.match(FORMS[form](chain, dtype)), ix.held(1)

    kind, got = outcome(scenario)
    assert kind == "ok" and got[0] == [0, len(chain)] and sorted(got[1]) == chain


def load_reference():
    from conftest import load_impl

    return load_impl("reference")


@pytest.mark.parametrize("on", [True, False, np.bool_(True), 1, None, "yes"])
def test_release_gil_always_takes_only_a_bool(on):
    """The threaded tests' hook (cpp/bindings/gil.hpp) and its reference twin agree."""
    from conftest import load_impl

    try:
        kind, _ = same(lambda m: m._release_gil_always(on))
    finally:
        load_impl("native")._release_gil_always(False)
    assert kind == ("ok" if isinstance(on, (bool, np.bool_)) else "raise")
