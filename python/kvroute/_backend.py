"""Choose the implementation behind kvroute's public names.

KVROUTE_IMPLEMENTATION=native (default) uses the compiled core, kvroute._native; =python
uses the pure-Python reference twin, kvroute.reference. When the native module cannot be
imported, kvroute falls back to the reference with a warning rather than failing.
"""

from __future__ import annotations

import os
import types
import warnings

_VALID = ("native", "python")


def _load() -> tuple[types.ModuleType, str]:
    wanted = os.environ.get("KVROUTE_IMPLEMENTATION", "native").strip().lower() or "native"
    if wanted not in _VALID:
        raise ImportError(
            f"KVROUTE_IMPLEMENTATION={wanted!r} is not one of {', '.join(_VALID)}"
        )
    if wanted == "native":
        try:
            from . import _native

            return _native, "native"
        except ImportError as exc:  # pragma: no cover - depends on the build
            warnings.warn(
                f"kvroute: the native core could not be imported ({exc}); "
                "using the pure-Python reference implementation, which is much slower",
                RuntimeWarning,
                stacklevel=3,
            )
    from . import reference

    return reference, "python"


backend, implementation = _load()
