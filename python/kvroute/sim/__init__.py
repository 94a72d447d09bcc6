"""kvroute.sim: a deterministic, event-driven fleet simulator for comparing routers.

    from kvroute import sim
    wl = sim.chat(replicas=8, seed=0)
    for res in sim.compare(wl, ["round-robin", "sticky", "cache-aware", "ttft"]):
        print(res.router, res.metrics.hit_rate, res.metrics.ttft_p90)

The parts: workloads (chat, shared_prefix, trace), the fleet model (FleetParams,
simulate), the metrics (Metrics) and the router names (router_spec). `kvroute simulate`
is the command-line front end; scripts/results.py regenerates docs/results.md with it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .fleet import KNOWLEDGE, FleetParams, Record, SimResult, make_router, simulate
from .metrics import Metrics
from .routers import ALL_ROUTERS, DEFAULT_ROUTERS, RouterSpec, router_spec
from .workloads import (
    ChatParams,
    Client,
    SharedPrefixParams,
    TraceParams,
    Turn,
    Workload,
    chat,
    shared_prefix,
    trace,
)

WORKLOADS = ("chat", "shared-prefix", "trace")


def build_workload(name: str, *, path: str | None = None, replicas: int = 8, seed: int = 0,
                   time_scale: float = 1.0, rate: float | None = None) -> Workload:
    """A workload by name: "chat" (sized for `replicas`), "shared-prefix" (rate: None =
    all at t=0, else requests per second) or "trace" (path required; time_scale)."""
    if name == "chat":
        return chat(ChatParams(), replicas, seed)
    if name == "shared-prefix":
        return shared_prefix(SharedPrefixParams(rate=rate), seed)
    if name == "trace":
        if path is None:
            raise ValueError("the trace workload needs a PATH to a Mooncake JSONL trace")
        return trace(path, TraceParams(time_scale=time_scale))
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def compare(
    workload: Workload,
    routers: Iterable[str | RouterSpec],
    fleet: FleetParams | None = None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SimResult]:
    """Simulate the same workload and fleet under each router, in order.

    progress(router name, done, total) is called as requests complete.
    """
    specs = [r if isinstance(r, RouterSpec) else router_spec(r) for r in routers]
    results = []
    for spec in specs:
        cb: Any = None
        if progress is not None:
            cb = (lambda name: lambda done, total: progress(name, done, total))(spec.name)
        results.append(simulate(workload, spec, fleet, progress=cb))
    return results


__all__ = [
    "ALL_ROUTERS", "DEFAULT_ROUTERS", "KNOWLEDGE", "WORKLOADS",
    "ChatParams", "Client", "FleetParams", "Metrics", "Record", "RouterSpec", "SharedPrefixParams",
    "SimResult", "TraceParams", "Turn", "Workload",
    "build_workload", "chat", "compare", "make_router", "router_spec", "shared_prefix", "simulate",
    "trace",
]
