"""kvroute.emulate: engines that speak like vLLM, on the engine model, without a GPU.

`kvroute emulate --replicas N` runs N emulated engines in one process: each serves vLLM's
OpenAI-compatible HTTP API (app.py, protocol.py), publishes its KV cache's events on vLLM's
ZMQ wire (publisher.py, wire.py) and exposes vLLM's Prometheus metrics (metrics.py),
while kvroute.sim.engine schedules its requests against the wall clock (runner.py).
Needs the `emulate` extra (uvicorn, uvloop, httptools, pyzmq, msgspec); the names below
are imported on first use so that `kvroute --help` works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EmulatedEngine", "EmulatorOptions", "EnginePorts", "Fleet", "FleetThread"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import fleet

        return getattr(fleet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
