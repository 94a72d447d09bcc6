"""The twin of kvroute._native._release_gil_always (cpp/bindings/gil.hpp), a testing hook.

The native bindings keep the GIL for short calls; threaded tests make every call release it.
Pure Python holds the GIL throughout, so here the switch is checked and changes nothing.
"""

from __future__ import annotations

import numpy as np


def _release_gil_always(on: bool) -> None:
    """Testing only: checks `on` like the native hook; the reference has no GIL to release."""
    if not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
