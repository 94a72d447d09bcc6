"""One replica's EventApplier state as bytes and back, reference twin of cpp/src/events_state.cpp.

The layout (docs/snapshot-format.md, "Applier state") lists, after the applier's block size
and salt, the replica's own salt, counters, learned engine block, the media the applier
knows, then per KV-cache group its entries (oldest stored first) and its per-tier router
block reference counts (by hash). Everything is read and checked before anything changes.
"""

from __future__ import annotations

from typing import Any

import xxhash

from .binio import Reader, Writer

_WHAT = "applier state"
_NO_PARENT = (1 << 64) - 1
_FLAG_DEP, _FLAG_OK0, _FLAG_OK1, _FLAG_EXTRA = 1, 2, 4, 8
_ENTRY_MIN = 8 * 5 + 1 + 4  # key, end, seed, seq, media, flags, n_kv


def encode(applier: Any, r: int) -> bytes:
    """The replica's state (a fresh one when the applier never saw it)."""
    from .events import SKIP_KINDS, _GPU, _Replica

    st = applier._replicas.get(r) or _Replica()
    w = Writer()
    w.u32(applier._block_size)
    w.text(applier._salt)
    w.u64(applier._seq)
    _opt_bytes(w, st.salt)
    w.u64(st.batches)
    for kind in SKIP_KINDS:
        w.u64(st.skipped[kind])
    w.u64(st.k)
    _opt_u64(w, st.engine_block_size)
    w.u8(st.last_ts is not None)
    w.f64(0.0 if st.last_ts is None else st.last_ts)
    media = sorted(m for m in applier._media if m != _GPU)
    w.u32(len(media))
    for m in media:
        w.text(m.encode("utf-8"))
    bit = {_GPU: 1} | {m: 1 << (i + 1) for i, m in enumerate(media)}
    w.u32(len(st.groups))
    for gid in sorted(st.groups):
        _encode_group(w, gid, st.groups[gid], bit)
    return bytes(w.buf)


def _encode_group(w: Writer, gid: int, g: Any, bit: dict[str, int]) -> None:
    w.u32(gid)
    _opt_u64(w, g.engine_block_size)
    entries = sorted(g.entries.values(), key=lambda e: e.seq)
    w.u64(len(entries))
    for e in entries:
        _encode_entry(w, e, bit)
    for refs in g.refs:
        w.u64(len(refs))
        for x in sorted(refs):
            w.u64(x)
            w.u32(refs[x])


def _encode_entry(w: Writer, e: Any, bit: dict[str, int]) -> None:
    extra = bool(e.lead or e.tail or e.tail_mm or e.dependents)
    w.u64(e.key)
    w.u64(e.end)
    w.u64(e.seed)
    w.u64(e.seq)
    w.u64(sum(bit[m] for m in e.media))
    w.u8(_FLAG_DEP * e.dep + _FLAG_OK0 * e.first_ok[0] + _FLAG_OK1 * e.first_ok[1] + _FLAG_EXTRA * extra)
    w.u32(len(e.kv))
    for x in e.kv:
        w.u64(x)
    if not extra:
        return
    w.u64(e.start)
    w.u32(e.lead)
    w.u64(_NO_PARENT if e.parent is None else e.parent)
    w.u8(e.parent is not None)
    w.u32(len(e.tail) // 4)
    w.raw(e.tail)
    w.u32(len(e.tail_mm))
    for ident, off in e.tail_mm:
        w.text(ident)
        w.u64(off)
    w.u32(len(e.dependents))
    for d in e.dependents:
        w.u64(d)


def decode(data: bytes, block_size: int, salt: bytes) -> dict[str, Any]:
    """The state in `data` as plain values; ValueError when it is cut short, malformed or
    written for another block size or salt."""
    from .events import MAX_GROUPS, MAX_MEDIA, SKIP_KINDS

    rd = Reader(data, _WHAT)
    bs = rd.u32()
    if bs != block_size:
        raise ValueError(f"applier state was written for block_size {bs}, this applier has {block_size}")
    if rd.text() != salt:
        raise ValueError("applier state was written for another salt than this applier's")
    seq = rd.u64()
    out: dict[str, Any] = {"seq": seq, "salt": _read_opt_bytes(rd), "batches": rd.u64()}
    out["skipped"] = {kind: rd.u64() for kind in SKIP_KINDS}
    out["k"] = rd.u64()
    if not 1 <= out["k"] <= 65536:
        raise ValueError(f"applier state is corrupt: engine block {out['k']} is out of range")
    out["engine_block_size"] = _read_opt_u64(rd)
    has_ts = _flag(rd)
    ts = rd.f64()
    out["last_ts"] = ts if has_ts else None
    media = [_utf8(rd.text(), "medium") for _ in range(rd.u32())]
    if len(media) + 1 > MAX_MEDIA or len(set(media)) != len(media) or "GPU" in media:
        raise ValueError("applier state is corrupt: bad media table")
    out["media"] = media
    groups: dict[int, Any] = {}
    for _ in range(rd.u32()):
        gid = rd.u32()
        if gid >= MAX_GROUPS or gid in groups:
            raise ValueError(f"applier state is corrupt: bad group {gid}")
        groups[gid] = _decode_group(rd, len(media), seq)
    out["groups"] = groups
    if rd.left():
        raise ValueError("applier state is corrupt: trailing bytes")
    return out


def _decode_group(rd: Reader, n_media: int, seq: int) -> dict[str, Any]:
    ebs = _read_opt_u64(rd)
    entries = []
    seen: set[int] = set()
    last_seq = 0
    for _ in range(rd.count(_ENTRY_MIN)):
        e = _decode_entry(rd, n_media)
        if e["key"] in seen or e["seq"] <= last_seq or e["seq"] > seq:
            raise ValueError("applier state is corrupt: entries repeat or are out of order")
        seen.add(e["key"])
        last_seq = e["seq"]
        entries.append(e)
    refs = []
    for _ in range(2):
        tier: dict[int, int] = {}
        prev = -1
        for _ in range(rd.count(12)):
            x, c = rd.u64(), rd.u32()
            if x <= prev or c == 0:
                raise ValueError("applier state is corrupt: reference counts out of order")
            tier[x] = c
            prev = x
        refs.append(tier)
    return {"engine_block_size": ebs, "entries": entries, "refs": refs}


def _decode_entry(rd: Reader, n_media: int) -> dict[str, Any]:
    e: dict[str, Any] = {"key": rd.u64(), "end": rd.u64(), "seed": rd.u64(), "seq": rd.u64(), "media": rd.u64()}
    flags = rd.u8()
    if flags > 15 or e["media"] == 0 or e["media"] >> (n_media + 1):
        raise ValueError("applier state is corrupt: bad entry flags or media")
    e["flags"] = flags
    n_kv = rd.u32()
    if n_kv * 8 > rd.left():
        raise ValueError(f"{_WHAT} is truncated")
    e["kv"] = tuple(rd.u64() for _ in range(n_kv))
    if flags & _FLAG_EXTRA:
        e["start"], e["lead"] = rd.u64(), rd.u32()
        parent = rd.u64()
        e["parent"] = parent if _flag(rd) else None
        n_tail = rd.u32()
        e["tail"] = rd.raw(4 * n_tail)
        mm = []
        for _ in range(rd.u32()):
            ident = rd.text()
            mm.append((ident, rd.u64()))
        e["tail_mm"] = tuple(mm)
        n_dep = rd.u32()
        if n_dep * 8 > rd.left():
            raise ValueError(f"{_WHAT} is truncated")
        e["dependents"] = [rd.u64() for _ in range(n_dep)]
    return e


def install(applier: Any, r: int, state: dict[str, Any]) -> None:
    """Replaces the replica's state with a decoded one (the indexes are not touched)."""
    from .events import _GPU, _Entry, _Group, _Replica

    st = _Replica()
    if state["salt"] is not None:
        st.salt = state["salt"]
        st.root = xxhash.xxh3_64_intdigest(st.salt, 0)
    st.batches = state["batches"]
    st.skipped = dict(state["skipped"])
    st.k = state["k"]
    st.engine_block_size = state["engine_block_size"]
    st.last_ts = state["last_ts"]
    names = [_GPU, *state["media"]]
    applier._media.update(names)
    top = max(applier._seq, state["seq"])
    for gid, gs in state["groups"].items():
        g = st.groups[gid] = _Group()
        g.engine_block_size = gs["engine_block_size"]
        g.refs = (dict(gs["refs"][0]), dict(gs["refs"][1]))
        for es in gs["entries"]:
            e = _entry(_Entry(), es, names)
            g.entries[e.key] = e
            top = max(top, e.seq)
    applier._seq = top
    applier._replicas[r] = st


def _entry(e: Any, es: dict[str, Any], names: list[str]) -> Any:
    flags = es["flags"]
    e.key, e.end, e.seed, e.seq, e.kv = es["key"], es["end"], es["seed"], es["seq"], es["kv"]
    e.dep = bool(flags & _FLAG_DEP)
    e.first_ok = [bool(flags & _FLAG_OK0), bool(flags & _FLAG_OK1)]
    e.media = {m for i, m in enumerate(names) if es["media"] >> i & 1}
    if flags & _FLAG_EXTRA:
        e.start, e.lead, e.parent = es["start"], es["lead"], es["parent"]
        e.tail, e.tail_mm, e.dependents = es["tail"], es["tail_mm"], list(es["dependents"])
    else:
        e.start, e.lead, e.parent, e.tail, e.tail_mm, e.dependents = es["end"], 0, None, b"", (), []
    return e


def _opt_bytes(w: Writer, v: bytes | None) -> None:
    w.u8(v is not None)
    w.text(b"" if v is None else v)


def _read_opt_bytes(rd: Reader) -> bytes | None:
    has = _flag(rd)
    v = rd.text()
    return v if has else None


def _opt_u64(w: Writer, v: int | None) -> None:
    w.u8(v is not None)
    w.u64(0 if v is None else v)


def _read_opt_u64(rd: Reader) -> int | None:
    has = _flag(rd)
    v = rd.u64()
    return v if has else None


def _flag(rd: Reader) -> bool:
    v = rd.u8()
    if v > 1:
        raise ValueError(f"applier state is corrupt: flag byte {v}")
    return v == 1


def _utf8(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"applier state is corrupt: a {what} is not valid UTF-8") from None


__all__ = ["decode", "encode", "install"]
