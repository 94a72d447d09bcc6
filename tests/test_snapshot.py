"""Router snapshots (contract C7, docs/snapshot-format.md) on both implementations: round trips,
files byte-identical across implementations and restored by either, corrupt, truncated,
forged and foreign files refused with the router unchanged, the argument checks, and
PrefixIndex.export_replica/import_replica. Precise mode with an EventApplier, restarted mid-run
against an uninterrupted twin, is tests/test_snapshot_precise.py."""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import same
from conftest import load_impl

from kvroute import RouterConfig

import kvroute.reference as R

T = 100.0
CONFIGS = [
    dict(block_size=4),
    dict(block_size=4, index_capacity=40, index_ttl=60.0, salt="tenant"),
    dict(block_size=4, mode="hybrid", session_ttl=200.0),
]


def fleet(M, cfg: RouterConfig, seed: int = 0):
    """A router of three replicas (one with 2-block engine blocks) after 40 routed prompts."""
    r = M.Router(cfg, ["a", "b"])
    r.add_replica("c", engine_block_size=2 * cfg.block_size)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50, size=48)
    for i in range(40):
        n = int(rng.integers(4, 48))
        prompt = np.concatenate([base[: n // 2], rng.integers(0, 50, size=n - n // 2)])
        d = r.route(prompt, session=f"s{i % 9}", now=float(i))
        if cfg.mode != "approximate":  # what the engine's events would add
            r.index.insert(d.replica_id, M.block_hashes(prompt, cfg.block_size, salt=cfg.salt), now=float(i))
        if i % 3:
            r.finish(d.handle)
    return r


def exports(r, now: float) -> dict[str, list[list]]:
    """Each replica's index contents by name, as lists."""
    return {n: [a.tolist() for a in r.index.export_replica(r.replica_id(n), now)] for n in r.replicas}


def summary(r, now: float) -> tuple:
    """What a failed restore must leave as it was."""
    st = r.index.stats()
    return exports(r, now), r.stats()["sessions"], st["blocks"], st["nodes"], [r.engine_block(n) for n in r.replicas]


def probes(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50, size=48)
    return [np.concatenate([base[: int(n) // 2], rng.integers(0, 50, size=int(n) - int(n) // 2)])
            for n in rng.integers(4, 48, size=40)]


@pytest.mark.parametrize("kw", CONFIGS)
def test_round_trip_restores_index_engine_blocks_sessions_and_cursors(impl, tmp_path, kw):
    cfg = RouterConfig(**kw)
    r = fleet(impl, cfg)
    path = tmp_path / "snap"
    cursors = {"a": {"seq": 7, "digest": 2**64 - 1}, "c": {"seq": 0, "digest": 5}}
    info = r.snapshot(path, cursors=cursors, now=T)
    assert info["replicas"] == ["a", "b", "c"] and info["bytes"] == os.path.getsize(path)
    assert info["blocks"] == sum(r.index.blocks(i) for i in range(3)) > 0
    assert not os.path.exists(str(path) + ".tmp")
    r2 = impl.Router(cfg, ["other", "b"])  # b is replaced, other stays, a and c are added
    r2.route(np.arange(12), session="mine", now=T)
    res = r2.restore(str(path), now=T)
    assert res["replicas"] == ["a", "b", "c"] and res["cursors"] == cursors
    assert res["blocks"] == info["blocks"] and 0 <= res["age"] < 60
    assert res["sessions"] == info["sessions"] == r.stats()["sessions"]
    assert r2.replicas == ["other", "b", "a", "c"]
    assert {n: v for n, v in exports(r2, T).items() if n != "other"} == exports(r, T)
    assert [r2.engine_block(n) for n in "abc"] == [1, 1, 2]
    assert r2.stats()["sessions"] == r.stats()["sessions"] + 1  # "mine" is on a replica not restored
    ids = {n: r.replica_id(n) for n in "abc"}
    ids2 = {n: r2.replica_id(n) for n in "abc"}
    for p in probes():
        hashes = impl.block_hashes(p, cfg.block_size, salt=cfg.salt)
        m, m2 = r.index.match(hashes), r2.index.match(hashes)
        assert [m[ids[n]] for n in "abc"] == [m2[ids2[n]] for n in "abc"]
    for s in range(9):  # every saved session is kept on its replica by both
        a = r.route(np.arange(8), session=f"s{s}", now=T + 1)
        b = r2.route(np.arange(8), session=f"s{s}", now=T + 1)
        assert (a.replica, a.binding) == (b.replica, b.binding) == (a.replica, "kept")
    r2.index.check_invariants()


def test_sessions_age_and_expire_across_a_restore(impl, tmp_path):
    cfg = RouterConfig(block_size=4, session_ttl=10.0)
    r = impl.Router(cfg, ["a", "b"])
    r.route(np.arange(8), session="old", now=0.0)
    r.route(np.arange(8, 16), session="new", now=8.0)
    r.snapshot(tmp_path / "s", now=9.0)  # ages 9 and 1
    r2 = impl.Router(cfg, ["a", "b"])
    assert r2.restore(tmp_path / "s", now=1000.0)["sessions"] == 2
    assert r2.route(np.arange(8), session="old", now=1001.5).binding == "new"  # 10.5 s: expired
    assert r2.route(np.arange(8, 16), session="new", now=1008.5).binding == "kept"  # 9.5 s
    r3 = impl.Router(cfg, ["a", "b"])
    assert r3.restore(tmp_path / "s", now=1000.0)["sessions"] == 2
    r.snapshot(tmp_path / "t", now=12.0)  # "old" expired at 10: not saved
    assert r3.restore(tmp_path / "t", now=0.0)["sessions"] == 1


def _mask_time(data: bytes, salt: bytes) -> bytes:
    """The file without CONF's wall-clock stamp and the checksum (which covers it)."""
    at = 7 + 2 + 4 + 8 + 1 + 4 + 4 + len(salt)
    return data[:at] + data[at + 8 : -8]


@pytest.mark.parametrize("kw", CONFIGS)
def test_both_implementations_write_the_same_bytes_and_read_each_other(tmp_path, kw):
    cfg = RouterConfig(**kw)
    files = {}
    for name in ("native", "reference"):
        M = load_impl(name)
        r = fleet(M, cfg, seed=1)
        r.snapshot(tmp_path / name, cursors={"b": {"seq": 1, "digest": 2}}, now=T)
        files[name] = (tmp_path / name).read_bytes()
    salt = cfg.salt_bytes()
    assert _mask_time(files["native"], salt) == _mask_time(files["reference"], salt)
    got = []
    for reader in ("native", "reference"):
        for writer in ("native", "reference"):
            r2 = load_impl(reader).Router(cfg)
            r2.restore(tmp_path / writer, now=T)
            got.append(exports(r2, T))
    assert all(g == got[0] for g in got)


# -- refusals -----------------------------------------------------------------------------------


def _baseline(cfg: RouterConfig) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        fleet(R, cfg, seed=2).snapshot(os.path.join(d, "s"), cursors={"a": {"seq": 1, "digest": 1}}, now=T)
        with open(os.path.join(d, "s"), "rb") as f:
            return f.read()


BASE = _baseline(RouterConfig(block_size=4, index_capacity=40, index_ttl=60.0))


def _forge(data: bytes) -> bytes:
    """data with a valid checksum again (a file written by a buggy or hostile writer)."""
    body = data[:-8]
    return body + struct.pack("<Q", R.xxh3_64(body))


def _restore_outcome(data: bytes, cfg: RouterConfig) -> list:
    """Restoring `data` on both implementations: the outcome, and the victim router's state
    before and after (which a refused restore leaves unchanged)."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s")
        with open(p, "wb") as f:
            f.write(data)
        for name in ("native", "reference"):
            r = fleet(load_impl(name), cfg, seed=3)
            before = summary(r, T)
            try:
                res = r.restore(p, now=T)
                res.pop("age")
                out.append(("ok", res))
            except ValueError as exc:
                out.append(("ValueError", str(exc)))
                assert summary(r, T) == before
            out.append(summary(r, T))
    assert out[:2] == out[2:], "implementations disagree"
    return out


CFG = RouterConfig(block_size=4, index_capacity=40, index_ttl=60.0)


@settings(max_examples=40)
@given(st.data())
def test_flipped_truncated_or_extended_files_are_refused_and_change_nothing(data):
    kind = data.draw(st.sampled_from(["flip", "truncate", "append"]))
    raw = bytearray(BASE)
    if kind == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=32))
    out = _restore_outcome(bytes(raw), CFG)
    assert out[0][0] == "ValueError"
    assert any(w in out[0][1] for w in ("bad magic", "truncated", "checksum", "version"))


@settings(max_examples=100)
@given(st.data())
def test_forged_files_are_refused_whole_or_loaded_alike(data):
    """Flipped bytes under a recomputed checksum reach every check past it: each
    implementation refuses the file with the same message and no change, or loads it the same."""
    raw = bytearray(BASE[:-8])
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(9, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _restore_outcome(_forge(bytes(raw) + b"\0" * 8), CFG)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b"KVRSNAQ" + b[7:], "not a kvroute snapshot (bad magic)"),
        (lambda b: b"", "not a kvroute snapshot (bad magic)"),
        (lambda b: b[:8], "snapshot is truncated"),
        (lambda b: _forge(b[:7] + b"\x02\x00" + b[9:]), "snapshot version 2 is not supported (this kvroute reads version 1)"),
        (lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:], "snapshot checksum does not match: the file is corrupt or truncated"),
        (lambda b: _forge(b[:-8] + b"XTRA" + bytes(8) + bytes(8)), "snapshot has an unknown required section 58545241"),
    ],
)
def test_foreign_and_damaged_files_name_the_problem(edit, message):
    out = _restore_outcome(edit(BASE), CFG)
    assert out[0] == ("ValueError", message)


def test_optional_sections_are_skipped():
    out = _restore_outcome(_forge(BASE[:-8] + b"xtra" + struct.pack("<Q", 3) + b"abc" + bytes(8)), CFG)
    assert out[0][0] == "ok"


def _cursor_section(cursors: list[tuple[str, int, int]]) -> bytes:
    payload = struct.pack("<Q", len(cursors)) + b"".join(
        struct.pack("<I", len(n)) + n.encode() + struct.pack("<QQ", seq, dig) for n, seq, dig in cursors)
    return b"CURS" + struct.pack("<Q", len(payload)) + payload


def test_a_repeated_cursor_name_keeps_its_first_place_and_last_value():
    """A forged CURS section naming replicas again (thousands of times: no quadratic restore)
    reads like a dict built from it, on both implementations."""
    at = BASE.index(_cursor_section([("a", 1, 1)]))
    names = [f"r{i}" for i in range(4000)]
    cursors = [(n, i, i) for i, n in enumerate(names)] + [(n, 7, 8) for n in names[::2]] + [("a", 5, 6)]
    data = _forge(BASE[:at] + _cursor_section(cursors) + BASE[at + len(_cursor_section([("a", 1, 1)])):])
    out = _restore_outcome(data, CFG)
    assert out[0][0] == "ok"
    got = out[0][1]["cursors"]
    assert list(got) == names + ["a"]
    assert got["r0"] == {"seq": 7, "digest": 8} and got["r1"] == {"seq": 1, "digest": 1}
    assert got["a"] == {"seq": 5, "digest": 6}


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(block_size=8), "snapshot was written for block_size 4, this router has 8"),
        (dict(block_size=4, salt="x"), "snapshot was written for another salt than this router's"),
        (dict(block_size=4, mode="precise"), "snapshot was written for mode 'approximate', this router runs 'precise'"),
    ],
)
def test_a_file_for_another_configuration_is_refused(kw, message):
    out = _restore_outcome(BASE, RouterConfig(**kw))
    assert out[0] == ("ValueError", message)


def test_policy_and_bounds_are_not_part_of_the_fingerprint():
    out = _restore_outcome(BASE, RouterConfig(block_size=4, policy="least_loaded", index_capacity=5))
    assert out[0][0] == "ok"
    assert out[1][0]["a"][2] and len(out[1][0]["a"][2]) <= 5  # capacity 5: the least recent were evicted


def test_arguments_are_checked_alike(tmp_path):
    cfg = RouterConfig(block_size=4)
    p = str(tmp_path / "s")

    def call(fn):
        return lambda M: fn(M.Router(cfg, ["a"]))

    same(call(lambda r: r.snapshot(3)))
    same(call(lambda r: r.snapshot(b"/tmp/x")))
    same(call(lambda r: r.snapshot("")))
    same(call(lambda r: r.snapshot(p, applier=3)))
    same(call(lambda r: r.snapshot(p, cursors=[1])))
    same(call(lambda r: r.snapshot(p, cursors={1: {}})))
    same(call(lambda r: r.snapshot(p, cursors={"a": {"seq": 1}})))
    same(call(lambda r: r.snapshot(p, cursors={"a": {"seq": -1, "digest": 0}})))
    same(call(lambda r: r.snapshot(p, cursors={"a": {"seq": 1.5, "digest": 0}})))
    same(call(lambda r: r.snapshot(p, cursors={"\ud800": {"seq": 1, "digest": 0}})))
    same(call(lambda r: r.snapshot(p, now=float("nan"))))
    same(call(lambda r: r.restore(str(tmp_path / "missing"))))
    same(lambda M: M.Router(cfg, ["a"]).snapshot(p, applier=M.EventApplier(M.PrefixIndex(1), 4)))
    same(lambda M: M.Router(cfg, ["a"]).snapshot(p, applier=M.EventApplier(M.Router(cfg).index, 4)))


def test_appliers_with_a_tier_index_or_another_block_size_are_refused(tmp_path):
    cfg = RouterConfig(block_size=4, mode="precise")
    p = str(tmp_path / "s")

    def tier(M):
        r = M.Router(cfg, ["a"])
        return r.snapshot(p, applier=M.EventApplier(r.index, 4, tier_index=M.PrefixIndex(1)))

    def size(M):
        r = M.Router(cfg, ["a"])
        return r.snapshot(p, applier=M.EventApplier(r.index, 8))

    assert same(tier)[0] == "raise" and same(size)[0] == "raise"


def test_a_file_without_applier_state_is_refused_when_an_applier_is_given(tmp_path):
    cfg = RouterConfig(block_size=4, mode="precise")
    R.Router(cfg, ["a"]).snapshot(tmp_path / "s", now=T)

    def restore(M):
        r = M.Router(cfg)
        return r.restore(tmp_path / "s", applier=M.EventApplier(r.index, 4))

    assert same(restore) == ("raise", ("ValueError", "snapshot has no event applier state for replica 'a'"))


# -- PrefixIndex.export_replica / import_replica ------------------------------------------------


def _index(M, **kw):
    ix = M.PrefixIndex(3, **kw)
    ix.insert(0, [1, 2, 3, 4], now=1.0)
    ix.insert(0, [1, 2, 5], now=2.0)
    ix.insert(1, [1, 2, 3, 7, 8], now=3.0)
    ix.insert(2, [9, 10], now=4.0)
    ix.remove(1, [3, 1])
    return ix


@pytest.mark.parametrize("kw", [{}, {"capacity": 5}, {"ttl": 10.0}])
def test_index_export_lists_held_blocks_and_their_ancestors_in_preorder(kw):
    def run(M):
        ix = _index(M, **kw)
        out = [a.tolist() for a in ix.export_replica(1, now=10.0)]
        ix2 = M.PrefixIndex(2, **kw)
        ix2.insert(0, [1, 2], now=0.0)
        held = ix2.import_replica(1, *ix.export_replica(1, now=10.0), now=20.0)
        ix2.check_invariants()
        return out, held, [a.tolist() for a in ix2.export_replica(1, now=20.0)], ix2.stats()["nodes"]

    same(run)
    (hashes, parents, held, ages), n, again, _ = run(R)
    assert hashes == [1, 2, 3, 7, 8] and parents == [-1, 0, 1, 2, 3]  # 1 and 3 are ancestors only
    assert sorted(held) == [1, 3, 4] and n == 3
    assert held == [4, 3, 1]  # untracked: reverse preorder; else LRU (a chain refreshes deepest first)
    assert ages == ([0.0] * 3 if not kw else [7.0] * 3)
    assert again[:3] == [hashes, parents, held]


@pytest.mark.parametrize(
    "args",
    [
        ([1, 2], [-1], [0], [0.0]),
        ([1, 2], [-1, 0], [0], [0.0, 1.0]),
        ([1, 2], [-1, 1], [0], [0.0]),
        ([1, 1], [-1, 0], [0], [0.0]),
        ([1, 2], [-1, 0], [2], [0.0]),
        ([1, 2], [-1, 0], [1, 1], [0.0, 0.0]),
        ([1, 2], [-1, 0], [1, 0], [0.0, 1.0]),
        ([1, 2], [-1, 0], [1], [float("inf")]),
        ([2, 9], [-1, 0], [1], [0.0]),
        ([1, 2], [[-1, 0]], [1], [0.0]),
        ([1, 2], [-1, 0], [1], ["x"]),
    ],
)
def test_index_import_refuses_what_no_export_gives_and_changes_nothing(args):
    def run(M):
        ix = _index(M, capacity=10)
        before = [a.tolist() for a in ix.export_replica(2, now=5.0)]
        try:
            ix.import_replica(2, *args, now=5.0)
        finally:
            assert [a.tolist() for a in ix.export_replica(2, now=5.0)] == before
        return None

    assert same(run)[0] == "raise"


chains = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.lists(st.integers(1, 40), max_size=6, unique=True),
                            st.booleans()), min_size=1, max_size=25)


@settings(max_examples=60)
@given(ops=chains, capacity=st.sampled_from([None, 6]))
def test_index_export_import_keeps_every_answer(ops, capacity):
    """Random chains (shared prefixes, removals, evictions) on three replicas: importing each
    replica's export into a fresh index, on either implementation, gives the same matches,
    the same export and the same node count."""
    kw = {} if capacity is None else {"capacity": capacity}
    results = []
    for name in ("native", "reference"):
        M = load_impl(name)
        ix = M.PrefixIndex(3, **kw)
        probes = []
        for t, (r, prefix, tail, drop) in enumerate(ops):
            chain = [1000 + p for p in range(prefix)] + [10_000 * (t + 1) + x for x in tail]
            ix.insert(r, chain, now=float(t))
            if drop and chain:
                ix.remove(r, chain[len(chain) // 2 :])
            probes.append(chain)
        for target in ("native", "reference"):
            ix2 = load_impl(target).PrefixIndex(3, **kw)
            for r in (2, 0, 1):
                ix2.import_replica(r, *ix.export_replica(r, now=50.0), now=50.0)
            ix2.check_invariants()
            assert [ix2.match(p).tolist() for p in probes] == [ix.match(p).tolist() for p in probes]
            assert ix2.stats()["nodes"] == ix.stats()["nodes"]
            results.append([[a.tolist() for a in ix2.export_replica(r, now=50.0)] for r in range(3)])
    assert all(x == results[0] for x in results)


def test_restored_sessions_beyond_the_table_are_evicted_least_recent_first(impl, tmp_path):
    cfg = RouterConfig(block_size=4)
    r = impl.Router(cfg, ["a", "b"])
    for i in range(5):
        r.route(np.arange(8) + i, session=f"s{i}", now=float(i))
    r.route(np.arange(8) + 9, session="a-long-id", now=5.0)
    r.snapshot(tmp_path / "s", now=10.0)
    small = impl.Router(RouterConfig(block_size=4, max_sessions=2), ["a", "b"])
    assert small.restore(tmp_path / "s", now=10.0)["sessions"] == 6
    assert small.stats()["sessions"] == 2 and small.stats()["session_evictions"] == 4
    assert small.route(np.arange(8) + 4, session="s4", now=11.0).binding == "kept"
    assert small.route(np.arange(8), session="s0", now=11.0).binding == "new"
    tiny = impl.Router(RouterConfig(block_size=4, max_session_bytes=2), ["a", "b"])
    tiny.route(np.arange(8), session="x", now=0.0)
    assert tiny.restore(tmp_path / "s", now=10.0)["sessions"] == 5  # the long id is skipped
    assert tiny.stats()["sessions"] == 1 and tiny.stats()["session_bytes"] == 2  # s4 pushed the rest out
    assert tiny.route(np.arange(8) + 4, session="s4", now=11.0).binding == "kept"


def test_applier_state_round_trips_and_refuses_what_it_cannot_take():
    def run(M):
        ix = M.PrefixIndex(2)
        ap = M.EventApplier(ix, 4)
        ap.apply_stored(0, [11, 12, 13], None, list(range(6)), block_size=2)
        ap.apply_stored(0, [14], 13, [6, 7], block_size=2, medium="CPU")
        ap.set_salt(1, "own")
        state = ap.export_replica(0)
        out = [len(state), ap.export_replica(1)]
        ap2 = M.EventApplier(M.PrefixIndex(2), 4)
        ap2.import_replica(1, state)
        out.append(ap2.export_replica(1) == state)
        before = ap2.export_replica(0)
        for bad in (state[:-1], state + b"\0", b"", 3, M.EventApplier(M.PrefixIndex(1), 8).export_replica(0)):
            try:
                ap2.import_replica(0, bad)
                out.append("ok")
            except (TypeError, ValueError) as exc:
                out.append((type(exc).__name__, str(exc)))
        out.append(ap2.export_replica(0) == before)
        tiered = M.EventApplier(M.PrefixIndex(1), 4, tier_index=M.PrefixIndex(1))
        for call in (lambda: tiered.export_replica(0), lambda: tiered.import_replica(0, state)):
            try:
                call()
            except ValueError as exc:
                out.append(str(exc))
        return out

    out = same(run)[1][1]
    assert out[2] is True and out[-3] is True
