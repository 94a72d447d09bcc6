"""Router snapshots: write and restore, reference twin of cpp/src/snapshot.cpp.

Router.snapshot(path, *, applier=None, cursors=None, now=None) and Router.restore(path, *,
applier=None, now=None) (contract C7) call these. The file layout, byte by byte, and what
is and is not saved are in docs/snapshot-format.md; in short: b"KVRSNAP", u16 version, a
sequence of tagged sections (CONF, then REPL per replica, APPL per replica with an applier,
SESS, CURS), and an XXH3-64 of everything before it. Both implementations write the same
bytes for the same state, and each restores the other's files.

restore() reads and checks the whole file (magic, version, checksum, lengths, fingerprint,
every section, and every chain against the router's index) before it changes anything, so
a failure (ValueError naming the problem) leaves router and applier as they were.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import xxhash

from .._snapshot_io import MAX_FILE_BYTES, cursors_arg, path_arg, read_file, write_atomic
from .binio import Reader, Writer
from .index import _now

MAGIC = b"KVRSNAP"
"""First 7 bytes of every snapshot file."""
VERSION = 1
"""The format version this module writes and reads."""

_MODES = ("approximate", "precise", "hybrid")
_ROOT = (1 << 64) - 1
_MAX_ENGINE_BLOCK = 65536
_HEAD = len(MAGIC) + 2
_SUM = 8


def snapshot(router: Any, path: Any, *, applier: Any = None, cursors: Any = None, now: Any = None) -> dict[str, Any]:
    """Write the router's state to `path` atomically (path + ".tmp", then os.replace)."""
    p = path_arg(path)
    _applier_arg(applier)
    curs = cursors_arg(cursors)
    t = time.monotonic() if now is None else _now(now)
    with router._lock:
        _check_applier(router, applier)
        data, info = _encode(router, applier, curs, t)
    write_atomic(p, data)
    info["bytes"] = len(data)
    return info


def restore(router: Any, path: Any, *, applier: Any = None, now: Any = None) -> dict[str, Any]:
    """Load a snapshot into the router (and applier); nothing changes unless all of it is valid."""
    p = path_arg(path)
    _applier_arg(applier)
    t = time.monotonic() if now is None else _now(now)
    data = read_file(p)
    with router._lock:
        _check_applier(router, applier)
        snap = _decode(data, router, applier)
        return _install(router, applier, snap, t)


# -- arguments ------------------------------------------------------------------------------


def _applier_arg(applier: Any) -> None:
    from .events import EventApplier

    if applier is not None and not isinstance(applier, EventApplier):
        raise TypeError(f"applier must be an EventApplier or None, got {type(applier).__name__}")


def _check_applier(router: Any, applier: Any) -> None:
    if applier is None:
        return
    if applier.index is not router._index:
        raise ValueError("applier must feed this router's index (EventApplier(router.index, ...))")
    if applier.tier_index is not None:
        raise ValueError("an applier with a tier_index cannot be exported or imported "
                         "(the tier index is not part of a snapshot)")
    if applier.block_size != router._bs:
        raise ValueError(f"applier block_size {applier.block_size} differs from the router's {router._bs}")


# -- writing --------------------------------------------------------------------------------


def _encode(router: Any, applier: Any, curs: list[tuple[bytes, int, int]], t: float) -> tuple[bytes, dict[str, Any]]:
    cfg = router._cfg
    w = Writer()
    w.raw(MAGIC)
    w.u16(VERSION)
    conf = Writer()
    conf.u8(_MODES.index(cfg.mode))
    conf.u32(router._bs)
    conf.text(router._salt)
    conf.f64(time.time())
    _section(w, b"CONF", conf)
    ids = [r for r, n in enumerate(router._names) if n is not None]
    blocks = 0
    for r in ids:
        rep = Writer()
        rep.text(router._names[r].encode("utf-8"))
        rep.u32(router._index.engine_block(r))
        blocks += _encode_index(rep, *router._index.export_replica(r, t))
        _section(w, b"REPL", rep)
    if applier is not None:
        for i, r in enumerate(ids):
            ap = Writer()
            ap.u32(i)
            ap.raw(applier.export_replica(r))
            _section(w, b"APPL", ap)
    sessions = router._export_sessions(t)
    ordinal = {r: i for i, r in enumerate(ids)}
    ss = Writer()
    ss.u64(len(sessions))
    for key, r, n_blocks, age in sessions:
        ss.text(key.encode("utf-8"))
        ss.u32(ordinal[r])
        ss.u64(n_blocks)
        ss.f64(age)
    _section(w, b"SESS", ss)
    cw = Writer()
    cw.u64(len(curs))
    for name, seq, digest in curs:
        cw.text(name)
        cw.u64(seq)
        cw.u64(digest)
    _section(w, b"CURS", cw)
    w.u64(xxhash.xxh3_64_intdigest(bytes(w.buf), 0))
    info = {"replicas": [router._names[r] for r in ids], "blocks": blocks, "sessions": len(sessions)}
    return bytes(w.buf), info


def _encode_index(w: Writer, hashes: np.ndarray, parents: np.ndarray, held: np.ndarray, ages: np.ndarray) -> int:
    w.u64(len(hashes))
    w.raw(np.column_stack([hashes, parents.astype(np.uint64)]).astype("<u8").tobytes() if len(hashes) else b"")
    w.u64(len(held))
    rec = np.empty(len(held), dtype=[("i", "<u8"), ("age", "<f8")])
    rec["i"] = held
    rec["age"] = ages
    w.raw(rec.tobytes())
    return len(held)


def _section(w: Writer, tag: bytes, body: Writer) -> None:
    w.raw(tag)
    w.u64(len(body.buf))
    w.raw(bytes(body.buf))


# -- reading --------------------------------------------------------------------------------


def _decode(data: bytes, router: Any, applier: Any) -> dict[str, Any]:
    """Every section, checked; ValueError naming the first problem."""
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a kvroute snapshot (bad magic)")
    if len(data) < _HEAD:
        raise ValueError("snapshot is truncated")
    version = int.from_bytes(data[len(MAGIC) : _HEAD], "little")
    if version != VERSION:
        raise ValueError(f"snapshot version {version} is not supported (this kvroute reads version {VERSION})")
    if len(data) < _HEAD + _SUM:
        raise ValueError("snapshot is truncated")
    if xxhash.xxh3_64_intdigest(data[:-_SUM], 0) != int.from_bytes(data[-_SUM:], "little"):
        raise ValueError("snapshot checksum does not match: the file is corrupt or truncated")
    rd = Reader(data, "snapshot", _HEAD, len(data) - _SUM)
    snap: dict[str, Any] = {"replicas": [], "appl": {}, "sessions": None, "cursors": None}
    first = True
    while rd.left():
        tag = rd.raw(4)
        length = rd.u64()
        if length > rd.left():
            raise ValueError("snapshot is truncated")
        body = Reader(data, "snapshot", rd.pos, rd.pos + length)
        rd.pos += length
        if first != (tag == b"CONF"):
            raise ValueError("snapshot is corrupt: the CONF section must come first, once")
        first = False
        _section_decode(tag, body, snap, router, applier)
        if body.left():
            raise ValueError(f"snapshot is corrupt: section {tag.hex()} has trailing bytes")
    if first or snap["sessions"] is None or snap["cursors"] is None:
        raise ValueError("snapshot is corrupt: a required section is missing")
    _check_whole(snap, router, applier)
    return snap


def _section_decode(tag: bytes, rd: Reader, snap: dict[str, Any], router: Any, applier: Any) -> None:
    if tag == b"CONF":
        snap["written"] = _conf(rd, router)
    elif tag == b"REPL":
        snap["replicas"].append(_replica(rd, len(snap["replicas"])))
    elif tag == b"APPL":
        i = rd.u32()
        if i >= len(snap["replicas"]) or i in snap["appl"]:
            raise ValueError("snapshot is corrupt: applier state for an unknown or repeated replica")
        blob = rd.raw(rd.left())
        if applier is not None:
            from . import events_state

            snap["appl"][i] = events_state.decode(blob, applier.block_size, applier.salt)
        else:
            snap["appl"][i] = None
    elif tag == b"SESS" and snap["sessions"] is None:
        snap["sessions"] = _sessions(rd)
    elif tag == b"CURS" and snap["cursors"] is None:
        snap["cursors"] = _cursors(rd)
    elif tag in (b"SESS", b"CURS"):
        raise ValueError(f"snapshot is corrupt: section {tag.hex()} is repeated")
    elif not 0x61 <= tag[0] <= 0x7A:  # a lowercase first letter marks a section readers may skip
        raise ValueError(f"snapshot has an unknown required section {tag.hex()}")
    else:
        rd.pos = rd.end


def _conf(rd: Reader, router: Any) -> float:
    mode = rd.u8()
    bs = rd.u32()
    salt = rd.text()
    written = rd.f64()
    cfg = router._cfg
    name = _MODES[mode] if mode < len(_MODES) else f"#{mode}"
    if name != cfg.mode:
        raise ValueError(f"snapshot was written for mode '{name}', this router runs '{cfg.mode}'")
    if bs != router._bs:
        raise ValueError(f"snapshot was written for block_size {bs}, this router has {router._bs}")
    if salt != router._salt:
        raise ValueError("snapshot was written for another salt than this router's")
    return written


def _replica(rd: Reader, i: int) -> dict[str, Any]:
    name = _utf8(rd.text(), f"replica {i}'s name")
    if not name:
        raise ValueError(f"snapshot is corrupt: replica {i} has an empty name")
    k = rd.u32()
    if not 1 <= k <= _MAX_ENGINE_BLOCK:
        raise ValueError(f"snapshot is corrupt: replica '{name}' has engine block {k}")
    n = rd.count(16)
    nodes = np.frombuffer(rd.raw(16 * n), dtype="<u8").reshape(n, 2)
    m = rd.count(16)
    rec = np.frombuffer(rd.raw(16 * m), dtype=[("i", "<u8"), ("age", "<f8")])
    hashes = nodes[:, 0].tolist()
    parents = [-1 if p == _ROOT else min(p, 1 << 62) for p in nodes[:, 1].tolist()]
    held = [min(x, 1 << 62) for x in rec["i"].tolist()]
    ages = rec["age"].tolist()
    return {"name": name, "k": k, "arrays": (hashes, parents, held, ages)}


def _sessions(rd: Reader) -> list[tuple[str, int, int, float]]:
    out = []
    for j in range(rd.count(24)):
        key = _utf8(rd.text(), f"session {j}")
        i = rd.u32()
        n_blocks = rd.u64()
        age = rd.f64()
        if n_blocks >= 1 << 63 or not (math.isfinite(age) and age >= 0):
            raise ValueError(f"snapshot is corrupt: session {j} has a bad block count or age")
        out.append((key, i, n_blocks, age))
    return out


def _cursors(rd: Reader) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for j in range(rd.count(20)):
        name = _utf8(rd.text(), f"cursor {j}")
        out[name] = {"seq": rd.u64(), "digest": rd.u64()}
    return out


def _check_whole(snap: dict[str, Any], router: Any, applier: Any) -> None:
    """What needs all sections: names, ordinals, applier states, chains against each other
    and against the router's index."""
    reps = snap["replicas"]
    names = [x["name"] for x in reps]
    if len(set(names)) != len(names):
        raise ValueError("snapshot is corrupt: a replica name is repeated")
    for j, (_, i, _, _) in enumerate(snap["sessions"]):
        if i >= len(reps):
            raise ValueError(f"snapshot is corrupt: session {j} names replica {i} of {len(reps)}")
    if applier is not None:
        media = set(applier._media)
        for i, x in enumerate(reps):
            st = snap["appl"].get(i)
            if st is None:
                raise ValueError(f"snapshot has no event applier state for replica '{x['name']}'")
            media.update(st["media"])
        from .events import MAX_MEDIA

        if len(media) > MAX_MEDIA:
            raise ValueError(f"applier state names too many media: an applier tells at most {MAX_MEDIA} apart")
    for x in reps:
        try:
            router._index._check_contents(*x["arrays"])
        except ValueError as exc:
            raise ValueError(f"snapshot replica '{x['name']}': {exc}") from None
    parent_of: dict[int, int] = {}
    for x in reps:
        hashes, parents, _, _ = x["arrays"]
        for j, h in enumerate(hashes):
            p = -1 if parents[j] < 0 else hashes[parents[j]]
            if parent_of.setdefault(h, p) != p:
                raise ValueError(f"snapshot is corrupt: block 0x{h:016x} has two parents")


def _utf8(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"snapshot is corrupt: {what} is not valid UTF-8") from None


# -- installing -----------------------------------------------------------------------------


def _install(router: Any, applier: Any, snap: dict[str, Any], t: float) -> dict[str, Any]:
    from . import events_state

    index = router._index
    ids = []
    blocks = 0
    for i, x in enumerate(snap["replicas"]):
        r = router._ids.get(x["name"])
        if r is None:
            r = router.add_replica(x["name"])
        ids.append(r)
        index.set_engine_block(r, x["k"])
        blocks += index.import_replica(r, *x["arrays"], now=t)
        if applier is not None:
            with applier._lock:
                events_state.install(applier, r, snap["appl"][i])
    records = [(key, ids[i], n, age) for key, i, n, age in snap["sessions"]]
    n_sessions = router._import_sessions(ids, records, t)
    return {
        "replicas": [x["name"] for x in snap["replicas"]],
        "blocks": blocks,
        "sessions": n_sessions,
        "cursors": snap["cursors"],
        "age": time.time() - snap["written"],
    }


__all__ = ["MAGIC", "MAX_FILE_BYTES", "VERSION", "restore", "snapshot"]
