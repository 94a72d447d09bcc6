"""Little-endian binary writing and bounds-checked reading, for snapshots (docs/snapshot-format.md).

Twin of cpp/src/binio.hpp. A Reader never reads past its end: a short read raises
ValueError("<what> is truncated"), where `what` names the whole (snapshot, applier state).
"""

from __future__ import annotations

import struct

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


class Writer:
    """Appends little-endian fields to a bytearray."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def u8(self, v: int) -> None:
        self.buf += _U8.pack(v)

    def u16(self, v: int) -> None:
        self.buf += _U16.pack(v)

    def u32(self, v: int) -> None:
        self.buf += _U32.pack(v)

    def u64(self, v: int) -> None:
        self.buf += _U64.pack(v)

    def f64(self, v: float) -> None:
        self.buf += _F64.pack(v)

    def raw(self, b: bytes) -> None:
        self.buf += b

    def text(self, b: bytes) -> None:
        """A byte string: u32 length, then the bytes."""
        self.buf += _U32.pack(len(b))
        self.buf += b


class Reader:
    """Reads little-endian fields from data[pos:end]; ValueError "<what> is truncated" past it."""

    __slots__ = ("data", "pos", "end", "what")

    def __init__(self, data: bytes | memoryview, what: str, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end
        self.what = what

    def _take(self, n: int) -> int:
        p = self.pos
        if n > self.end - p:
            raise ValueError(f"{self.what} is truncated")
        self.pos = p + n
        return p

    def u8(self) -> int:
        return int(self.data[self._take(1)])

    def u16(self) -> int:
        return int(_U16.unpack_from(self.data, self._take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack_from(self.data, self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self.data, self._take(8))[0])

    def f64(self) -> float:
        return float(_F64.unpack_from(self.data, self._take(8))[0])

    def raw(self, n: int) -> bytes:
        p = self._take(n)
        return bytes(self.data[p : p + n])

    def text(self) -> bytes:
        return self.raw(self.u32())

    def count(self, item_bytes: int) -> int:
        """A u64 item count, refused when that many items of at least item_bytes each
        cannot fit in what is left (so no count makes a reader allocate beyond the input)."""
        n = self.u64()
        if n * item_bytes > self.end - self.pos:
            raise ValueError(f"{self.what} is truncated")
        return n

    def left(self) -> int:
        return self.end - self.pos
