"""Differential helpers: call the same thing on both implementations and compare.

`same(fn)` runs fn(native_module) and fn(reference_module) and asserts that both return
equal results or both raise the same exception type with the same message.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from conftest import load_impl


def _normalize(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def outcome(fn: Callable[[Any], Any], module: Any) -> tuple[str, Any]:
    """('ok', normalized result) or ('raise', (exception type name, message))."""
    try:
        return "ok", _normalize(fn(module))
    except Exception as exc:  # noqa: BLE001 - the type is part of what is compared
        return "raise", (type(exc).__name__, str(exc))


def same(fn: Callable[[Any], Any]) -> tuple[str, Any]:
    """Assert fn gives the same outcome on native and reference; return that outcome."""
    got_native = outcome(fn, load_impl("native"))
    got_reference = outcome(fn, load_impl("reference"))
    assert got_native == got_reference, f"native {got_native!r} != reference {got_reference!r}"
    return got_native
