"""kvroute.sim: a deterministic, event-driven fleet simulator for comparing routers.

    from kvroute import sim
    wl = sim.chat(replicas=8, seed=0)
    for res in sim.compare(wl, ["round-robin", "sticky", "cache-aware", "ttft"]):
        print(res.router, res.metrics.hit_rate, res.metrics.ttft_p90)

The parts: workloads (chat, shared_prefix, trace), the engine model of one replica
(Engine: vLLM V1's scheduler and paged prefix cache, kvroute.sim.engine), the fleet of
engines (FleetParams, simulate), the metrics (Metrics), goodput under a TTFT SLO (sweep)
and the router names (router_spec). `kvroute simulate`
is the command-line front end; scripts/results.py regenerates docs/results.md with it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .engine import Engine, EngineConfig, EngineRequest, RequestOutput, StepResult
from .fleet import KNOWLEDGE, FleetParams, Record, SimResult, make_router, simulate
from .metrics import Metrics
from .routers import ALL_ROUTERS, DEFAULT_ROUTERS, RouterSpec, router_spec
from .sweep import DEFAULT_SLO, SweepPoint, SweepResult, sweep
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

#: Poisson arrival rate (requests/s) of shared-prefix when a sweep needs a rate to scale
#: (its published setting sends every request at t=0).
SWEEP_SHARED_PREFIX_RATE = 16.0


def fleet_for(workload: str, **overrides: Any) -> FleetParams:
    """FleetParams with the workload's default cache size (CACHE_TOKENS) and overrides."""
    if workload not in CACHE_TOKENS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    kwargs: dict[str, Any] = {"cache_tokens": CACHE_TOKENS[workload]}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    rate = kwargs.pop("prefill_rate", None)
    if rate is not None:  # tokens/s of a full step -> the engine's per-token cost
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"prefill_rate must be a number > 0, got {rate!r}")
        kwargs["per_token_s"] = 1.0 / float(rate)
    return FleetParams(**kwargs)


def workload_arg(words: list[str]) -> tuple[str, str | None]:
    """(name, path) from a `--workload NAME [PATH]` command-line value, checked: a known
    name, a PATH only with trace, and a trace file that exists."""
    import os

    name, *rest = words
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    if (name == "trace") != bool(rest) or len(rest) > 1:
        raise ValueError("use --workload trace PATH (a PATH only with trace)")
    path = rest[0] if rest else None
    if path is not None and not os.path.exists(path):
        raise ValueError(f"trace file {path!r} does not exist")
    return name, path


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
    "ALL_ROUTERS", "CACHE_TOKENS", "DEFAULT_ROUTERS", "DEFAULT_SLO", "KNOWLEDGE", "SWEEP_SHARED_PREFIX_RATE",
    "WORKLOADS", "ChatParams", "Client", "Engine", "EngineConfig", "EngineRequest", "FleetParams", "Metrics",
    "Record", "RequestOutput", "RouterSpec", "SharedPrefixParams", "SimResult", "StepResult", "SweepPoint",
    "SweepResult", "TraceParams", "Turn", "Workload",
    "build_workload", "chat", "compare", "fleet_for", "make_router", "router_spec", "shared_prefix", "simulate",
    "sweep", "trace", "workload_arg",
]
