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

#: KV cache per replica (tokens) each workload is simulated with by default. chat: the
#: explainer's 22 GB, the full history of 10 sessions. shared-prefix: the same fleet.
#: trace: the Mooncake trace's prompts average 12,000 tokens and its reuse spans minutes,
#: so a 22 GB cache would hold 13 prompts and hide every router difference; 1,048,576
#: tokens (2,048 blocks of 512) hold about 85, and an infinite cache would reach 37.3%.
CACHE_TOKENS = {"chat": 163_840, "shared-prefix": 163_840, "trace": 1_048_576}


def fleet_for(workload: str, **overrides: Any) -> FleetParams:
    """FleetParams with the workload's default cache size (CACHE_TOKENS) and overrides."""
    if workload not in CACHE_TOKENS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    kwargs: dict[str, Any] = {"cache_tokens": CACHE_TOKENS[workload]}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return FleetParams(**kwargs)


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
    "ALL_ROUTERS", "CACHE_TOKENS", "DEFAULT_ROUTERS", "KNOWLEDGE", "WORKLOADS",
    "ChatParams", "Client", "FleetParams", "Metrics", "Record", "RouterSpec", "SharedPrefixParams",
    "SimResult", "TraceParams", "Turn", "Workload",
    "build_workload", "chat", "compare", "fleet_for", "make_router", "router_spec", "shared_prefix", "simulate",
    "trace",
]
