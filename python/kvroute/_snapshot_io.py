"""Argument checks and file I/O shared by both Router.snapshot/restore implementations.

Like config.py, this is shared: the native binding calls these too, so both implementations
raise the same errors (OSError from the file system included) for the same arguments.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

_U64 = 1 << 64

MAX_FILE_BYTES = 1 << 34
"""Largest snapshot restore() reads (16 GiB); a bigger file is refused before it is read."""


def write_atomic(path: str, data: bytes) -> None:
    """data to path + ".tmp", flushed to disk, then renamed over path (atomic on POSIX)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_file(path: str) -> bytes:
    """The file's bytes; ValueError when it is larger than MAX_FILE_BYTES."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"snapshot is {size} bytes, more than the {MAX_FILE_BYTES} bytes restore reads")
        return f.read()


def path_arg(path: Any) -> str:
    """The path as a str (os.fspath); TypeError for anything else (bytes paths included)."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None
    if not isinstance(p, str):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not p:
        raise ValueError("path must not be empty")
    return p


def cursors_arg(cursors: Any) -> list[tuple[bytes, int, int]]:
    """{replica name: {"seq": int, "digest": int}} as (UTF-8 name, seq, digest), sorted by
    name; each int in [0, 2**64). None is no cursors."""
    if cursors is None:
        return []
    if not isinstance(cursors, Mapping):
        raise TypeError(f"cursors must be a mapping of replica name to {{'seq', 'digest'}}, got {type(cursors).__name__}")
    out = []
    for name, value in cursors.items():
        if not isinstance(name, str):
            raise TypeError(f"cursors keys must be str, got {type(name).__name__}")
        try:
            raw = name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"cursors key {name!r} is not valid UTF-8") from None
        if not isinstance(value, Mapping) or "seq" not in value or "digest" not in value:
            raise ValueError(f"cursors[{name!r}] must be a mapping with 'seq' and 'digest'")
        out.append((raw, _u64(value["seq"], f"cursors[{name!r}]['seq']"), _u64(value["digest"], f"cursors[{name!r}]['digest']")))
    out.sort()
    return out


def _u64(v: Any, what: str) -> int:
    """v as an int in [0, 2**64): TypeError unless it is an int (bools refused), ValueError
    outside the range."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(v).__name__}") from None
    if not 0 <= n < _U64:
        raise ValueError(f"{what} must be in [0, 2**64), got {n}")
    return n
