"""Argument checks shared by the reference twin; mirror of cpp/bindings/pyargs.hpp.

Every public function that takes text (a replica name, a session id, a medium, a salt) or an
integer array (tokens, hashes) converts it here, so the same object gets the same verdict and
the same message in both implementations, whichever function it is passed to.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def utf8_bytes(value: str, what: str) -> bytes:
    """A str argument as UTF-8, or ValueError naming `what` for a lone surrogate.

    UTF-8 cannot encode a lone surrogate (U+D800..U+DFFF unpaired), yet ``json.loads`` makes
    one from an escaped request body (``"\\ud800"``). kvroute refuses such text rather than
    inventing an encoding for it: a replica name, session id or medium is a key both
    implementations, their hashes and the engines' events must agree on byte for byte.
    """
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} must be encodable as UTF-8, got a lone surrogate at index {exc.start}"
        ) from None


def check_text(value: str, what: str) -> str:
    """`value` itself once utf8_bytes accepts it (ASCII, the common case, is not copied)."""
    if not value.isascii():
        utf8_bytes(value, what)
    return value


def refuse_masked(arr: np.ndarray, name: str) -> None:
    """TypeError for a numpy masked array: its mask would be silently ignored."""
    if isinstance(arr, np.ma.MaskedArray):
        raise TypeError(
            f"{name} must not be a numpy masked array (its mask cannot be honoured); "
            "pass .compressed() or .filled(value)"
        )


def int_buffer(value: Any) -> np.ndarray | None:
    """A buffer exporter other than str/bytes/bytearray/ndarray/array.array (a memoryview,
    say) as a numpy array over the same memory, or None when `value` exports no buffer.

    bytes and bytearray stay refused: raw bytes passed where integers belong are almost
    always a mistake, and a memoryview.cast("Q") says what is meant.
    """
    if isinstance(value, (str, bytes, bytearray)):
        return None
    try:
        view = memoryview(value)
    except TypeError:
        return None
    # A numpy scalar exports a 0-D buffer: one value, not an array.
    return np.asarray(view) if view.ndim else None
