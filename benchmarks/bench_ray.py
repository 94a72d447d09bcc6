"""kvroute's Ray Serve router vs Ray's PrefixCacheAffinityRouter vs Ray's power-of-two.

Not a pytest benchmark: a script that starts a local Ray cluster (ray.init, CPU only),
deploys, per router and workload, a fresh Serve deployment of --replicas
SimEngineReplica replicas (kvroute.sim.engine's vLLM model, its step times slept for real,
so prefix hits and queueing are real), replays the workload through a DeploymentHandle
and writes a table into docs/results.md (between the `bench-ray` markers).

Routers (benchmarks/ray_timed.py wraps each to time it):
- kvroute: KvrouteRequestRouter, policy ttft, tokenizer-free text mode (64-byte blocks),
  no session key (pure cache affinity, as Ray's prefix router).
- kvroute-session: the same, plus session_key="user" (the chat workload's conversation
  id; Ray's own session_id would do the same): what a deployment that has sessions gets.
  "kvroute:POLICY" in --routers runs another kvroute policy.
- ray-prefix: Ray's PrefixCacheAffinityRouter with its defaults (character tree in a
  detached actor; imbalanced_threshold inf, match_rate_threshold 0.1).
- ray-pow2: Ray's default PowerOfTwoChoicesRequestRouter.

Workloads, chat API (one user message per prompt; both prefix routers see the same text):
- chat: kvroute.sim.workloads.chat scaled down (users = 4 per replica, 2 conversations
  each, mean 4 turns, at most 8, 2,000-token mean final history), users concurrent, turns of a
  conversation back to back (no think time), answers capped at 16 tokens.
- shared-prefix: kvroute.sim.workloads.shared_prefix (8 groups x 12 prompts, 1,024-token
  system prompt + 64-token question), shuffled, 8 requests in flight.

Metrics: hit rate = cached tokens the engines report / prompt tokens; TTFT = the client's
end-to-end latency minus the replica's time from first token to the end (so routing,
Ray's queueing and the prefill are in it); routing time per request = time in the
router's choose_replicas and on_request_routed in the handle's process, over requests.

Run: python benchmarks/bench_ray.py [--replicas 4] [--write docs/results.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from kvroute.bench.prompts import chat_messages  # noqa: E402
from kvroute.integrations.ray_core import instances  # noqa: E402
from kvroute.integrations.ray_engine import SimEngineReplica, SimRequest  # noqa: E402
from kvroute.sim import workloads as wl  # noqa: E402
from docs_section import write_section  # noqa: E402  (scripts/docs_section.py)

ROUTERS = ("kvroute", "ray-prefix", "ray-pow2")
SECTION = "bench-ray"  # its marked section of docs/results.md


def router_config(name: str) -> Any:
    """The RequestRouterConfig of one router, timed ("kvroute:POLICY" picks a policy;
    "kvroute-session" also keys sessions on the request's `user` field)."""
    import ray_timed
    from ray.serve.config import RequestRouterConfig

    base = name.split(":")[0]
    cls = {"kvroute": ray_timed.TimedKvroute, "kvroute-session": ray_timed.TimedKvroute,
           "ray-prefix": ray_timed.TimedPrefix, "ray-pow2": ray_timed.TimedPow2}[base]
    kwargs: dict[str, Any] = {}
    if base.startswith("kvroute"):
        kwargs["policy"] = name.split(":")[1] if ":" in name else "ttft"
    if base == "kvroute-session":
        kwargs["session_key"] = "user"
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs)


def requests(workload: str, replicas: int, seed: int) -> list[list[SimRequest]]:
    """The workload as chains of requests (a chain runs in order; chains run at once)."""
    if workload == "chat":
        w = wl.chat(wl.ChatParams(sessions_per_replica=4, conversations_per_user=2, mean_turns=4.0, max_turns=8,
                                  history_tokens=2000, start_window=0.0), replicas=replicas, seed=seed)
    else:
        w = wl.shared_prefix(wl.SharedPrefixParams(groups=8, prompts_per_group=12, system_tokens=1024,
                                                   question_tokens=64, output_tokens=16), seed=seed)
    chains, key = [], 0
    for c in w.clients:
        chain = []
        for t in c.turns:
            key += 1
            chain.append(SimRequest(messages=chat_messages(t, w.block_tokens, key),
                                    max_tokens=int(min(t.output_tokens, 16)), user=t.session))
        chains.append(chain)
    return chains


async def replay(handle: Any, chains: list[list[SimRequest]], in_flight: int | None) -> list[dict[str, Any]]:
    """Send every chain (chat: all users at once; shared-prefix: `in_flight` at a time)."""
    out: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(in_flight or len(chains))

    async def run(chain: list[SimRequest]) -> None:
        async with sem:
            for req in chain:
                t0 = time.perf_counter()
                ans = await handle.remote(req)
                ans["e2e"] = time.perf_counter() - t0
                out.append(ans)

    await asyncio.gather(*(run(c) for c in chains))
    return out


def one_run(serve: Any, router: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """Deploy a fresh fleet behind `router`, replay `workload`, tear it down."""
    app = f"bench-{router.replace(':', '-')}-{workload}"
    dep = serve.deployment(SimEngineReplica, name="llm", num_replicas=args.replicas, max_ongoing_requests=64,
                           ray_actor_options={"num_cpus": 0}, request_router_config=router_config(router))
    handle = serve.run(dep.bind(num_kv_blocks=args.kv_blocks, time_scale=1.0), name=app, route_prefix=None)
    chains = requests(workload, args.replicas, args.seed)
    before = {id(r) for r in instances()}
    t0 = time.perf_counter()
    res = asyncio.run(replay(handle, chains, None if workload == "chat" else 8))
    wall = time.perf_counter() - t0
    timed = [r for r in instances() if id(r) not in before or getattr(r, "route_calls", 0)]
    timed = [r for r in timed if getattr(r, "route_calls", 0) and getattr(r, "_deployment_id", None)
             and r._deployment_id.app_name == app]
    route_ns = sum(r.route_ns for r in timed)
    serve.delete(app)
    ttft = np.array([r["e2e"] - r["decode_s"] for r in res])
    return {
        "router": router, "workload": workload, "requests": len(res), "wall": wall,
        "hit": sum(r["cached_tokens"] for r in res) / max(1, sum(r["prompt_tokens"] for r in res)),
        "p50": float(np.percentile(ttft, 50)), "p90": float(np.percentile(ttft, 90)),
        "route_us": route_ns / 1e3 / max(1, len(res)),
        "replicas_used": len({r["replica"] for r in res}),
    }


def table(rows: list[dict[str, Any]], cmd: str) -> str:
    """The markdown section."""
    lines = [
        "## Inside Ray Serve (bench_ray)", "",
        f"Generated by `{cmd}` (benchmarks/bench_ray.py) on this machine (2 shared CPU cores): a local "
        "Ray cluster, per run a fresh Serve deployment of simulated-engine replicas (kvroute.sim.engine, "
        "step times slept in real time), chat API text prompts through a DeploymentHandle. TTFT is the "
        "client's (routing and Ray's queueing included); routing time is the router's own time per request "
        "(choose_replicas + on_request_routed, in the handle's process).", "",
        "| workload | router | hit rate | p50 TTFT | p90 TTFT | routing time / request | requests | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['router']} | {r['hit']:.1%} | {r['p50'] * 1e3:.0f} ms | "
                     f"{r['p90'] * 1e3:.0f} ms | {r['route_us']:.0f} us | {r['requests']} | {r['wall']:.0f} s |")
    lines.append("")
    for w in sorted({r["workload"] for r in rows}):
        by = {r["router"]: r for r in rows if r["workload"] == w}
        if "kvroute" in by and "ray-prefix" in by:
            k, p = by["kvroute"], by["ray-prefix"]
            lines.append(
                f"- {w}: hit rate {k['hit']:.1%} vs {p['hit']:.1%} ({'higher' if k['hit'] > p['hit'] else 'NOT higher'}), "
                f"p90 TTFT {k['p90'] * 1e3:.0f} vs {p['p90'] * 1e3:.0f} ms ({'lower' if k['p90'] < p['p90'] else 'NOT lower'}), "
                f"routing time {p['route_us'] / max(k['route_us'], 1e-9):.0f}x lower than Ray's prefix router.")
    lines += [
        "",
        "Reading it: on chat, 66.0% is this workload's ceiling (every turn on its conversation's "
        "replica; the engines never cache the previous answer, which the next prompt repeats). Ray's prefix "
        "router reaches it by never balancing (its default imbalanced_threshold is inf), which is what costs "
        "it the p90; kvroute with a session key reaches it too, without sessions it trades about a point of "
        "hit rate for load. The routing times are measured inside the handle's process, where the "
        "benchmark's client shares the GIL with the router; a kvroute decision alone (key extraction + "
        "Router.route + finish) takes tens of microseconds on these prompts, Ray's prefix router spends its "
        "time in blocking ray.get calls to its tree actor.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks of 16 tokens per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="chat,shared-prefix")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--write", default=None, help="markdown file to write the table into")
    args = ap.parse_args()
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    rows = []
    try:
        for w in args.workloads.split(","):
            for r in args.routers.split(","):
                rows.append(one_run(serve, r, w, args))
                print(rows[-1], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    cmd = "python benchmarks/bench_ray.py " + " ".join(sys.argv[1:])
    block = table(rows, cmd.strip())
    print(block)
    if args.write:
        write_section(args.write, SECTION, block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
