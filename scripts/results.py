#!/usr/bin/env python3
"""Regenerate docs/results.md: every routing policy on the three simulator workloads.

    python scripts/results.py [--out docs/results.md] [--trace PATH] [--knowledge precise,hybrid]

The trace defaults to ../shared/traces/conversation_trace.jsonl relative to the
repository root. Each table is what `kvroute simulate` prints for the same workload,
fleet and routers (seed 0, 8 replicas); the exact command is written above each table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import kvroute
from kvroute import sim
from kvroute.sim import report, scenarios
from kvroute.sim.ideal import fraction_text, simulate_ideal

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "conversation_trace.jsonl"
EXTRA = ("p50 TTFT", "p99 TTFT", "cold p90", "rebinds")


def _table(results: list[sim.SimResult], best: dict[str, str]) -> str:
    lines = ["| " + " | ".join(report.COLUMNS + EXTRA) + " |", "|" + "---|" * (len(report.COLUMNS) + len(EXTRA))]
    for res, row in zip(results, report.rows(results)):
        m = res.metrics
        cells = row + [report.fmt_seconds(m.ttft_p50), report.fmt_seconds(m.ttft_p99),
                       report.fmt_seconds(m.cold_ttft_p90), str(m.rebinds)]
        for i, col in enumerate(report.COLUMNS):
            if best.get(col) == res.router:
                cells[i] = f"**{cells[i]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _best(results: list[sim.SimResult]) -> dict[str, str]:
    return {
        "hit rate": max(results, key=lambda r: r.metrics.hit_rate).router,
        "mean TTFT": min(results, key=lambda r: r.metrics.ttft_mean).router,
        "p90 TTFT": min(results, key=lambda r: r.metrics.ttft_p90).router,
    }


def _verdict(results: list[sim.SimResult]) -> str:
    ours = next((r for r in results if r.router == "ttft"), None)
    if ours is None:
        return ""
    peers = [r for r in results if r.router != "ttft"]
    best_p90 = min(peers, key=lambda r: r.metrics.ttft_p90)
    best_hit = max(peers, key=lambda r: r.metrics.hit_rate)
    p90_ok = ours.metrics.ttft_p90 < best_p90.metrics.ttft_p90
    hit_ok = ours.metrics.hit_rate >= best_hit.metrics.hit_rate
    return (f"ttft p90 {report.fmt_seconds(ours.metrics.ttft_p90)} vs the best peer's "
            f"{report.fmt_seconds(best_p90.metrics.ttft_p90)} ({best_p90.router}): "
            f"{'lower' if p90_ok else 'NOT lower'}; hit rate {ours.metrics.hit_rate:.1%} vs the best peer's "
            f"{best_hit.metrics.hit_rate:.1%} ({best_hit.router}): {'not lower' if hit_ok else 'LOWER'}.")


def _scenarios(routers: list[str]) -> list[str]:
    """The scale-out and deploy section: recovery per router on the chat workload."""
    out = ["## Scale-out and deploy (chat, precise knowledge)", "",
           "The ideal row above each table is kvroute.sim.ideal: one shared prefix cache with the fleet's "
           "total KV memory and one central FIFO queue (a replica takes the next request while its next "
           "step has token budget left); the line under each table is every router as a fraction of it "
           "(hit rate / ideal's; ideal p90 TTFT / its: 100% = as fast).", "",
           "Below, kvroute.sim.scenarios on the chat workload (8 replicas, seed 0): a change at 300 s. "
           "hit before = hit rate of the requests arriving in the 120 s before it; lowest window = the "
           "lowest hit rate of a 60 s window after it; recovered after = the end of the first 60 s window "
           "whose hit rate is back to 90% of the one before (window noise is a few points); new replicas' "
           "share = their share of the requests in the first window over their share of the fleet (above 1: "
           "a burst to cold replicas).", ""]
    wl = sim.build_workload("chat")
    fleet = sim.fleet_for("chat")
    for text in ("scale-out@300+2", "deploy@300"):
        sc = scenarios.parse(text)
        rows = []
        t0 = time.perf_counter()
        for r in routers:
            res = scenarios.simulate_scenario(wl, r, fleet, sc)
            rows.append((res, scenarios.measure_recovery(res, sc, fleet.replicas, window_s=60.0)))
            print(f"scenario {text} {r}: {res.wall_s:.1f} s", file=sys.stderr)
        what = "2 replicas join (8 -> 10)" if sc.kind == "scale-out" else "every replica restarts"
        out += [f"### {sc.kind}: {what} at 300 s", "", f"Simulated in {time.perf_counter() - t0:.0f} s.", "",
                f"    kvroute simulate --routers {','.join(routers)} --scenario {text}", "",
                scenarios.recovery_markdown(rows), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--knowledge", default="precise,hybrid",
                    help="comma-separated knowledge modes, one section each (default: %(default)s)")
    ap.add_argument("--routers", default=",".join(sim.ALL_ROUTERS))
    ap.add_argument("--scenario-routers", default="round-robin,sticky,least-loaded,cache-aware,dynamo,ttft",
                    help="routers of the scale-out and deploy section (default: %(default)s)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the trace path and the commands below are relative to the repository
    routers = args.routers.split(",")
    modes = args.knowledge.split(",")
    workloads = [("chat", None), ("shared-prefix", None), ("trace", args.trace)]
    started = time.perf_counter()
    out = [
        "# Simulated routing results",
        "",
        f"Generated by `python scripts/results.py` ({kvroute.implementation} implementation, "
        f"{datetime.date.today().isoformat()}). Every table: 8 replicas, seed 0, the simulator's default "
        "fleet (kvroute.sim.FleetParams: 10,000 prefill tokens/s, 20 ms overhead per prefill, 20 ms per "
        "output token) with the workload's cache size (kvroute.sim.CACHE_TOKENS). Hit rate = cached input "
        "tokens / input tokens; busiest/mean = the busiest replica's prefill seconds over the mean; fleet "
        "prefill = all replicas' prefill seconds; cold p90 = p90 TTFT of conversations' first turns. "
        "Bold: the best value in its column. Router names: kvroute.sim.routers (cache-aware is the seed's "
        "linear rule; only sticky is given session ids).",
        "",
        "Knowledge: *precise* = the router's index is fed every cache change of every replica at once "
        "(engine KV events); *hybrid* = the same plus the router's own speculative insert-on-route "
        "entries, which expire after RouterConfig.speculative_ttl (2 s).",
        "",
    ]
    ideals: dict[str, sim.SimResult] = {}
    for mode in modes:
        out += [f"## Knowledge: {mode}", ""]
        for name, path in workloads:
            if path is not None and not Path(path).exists():
                out += [f"### {name}", "", f"(skipped: {path} not found)", ""]
                continue
            wl = sim.build_workload(name, path=path)
            fleet = sim.fleet_for(name, knowledge=mode)
            t0 = time.perf_counter()
            results = []
            for r in routers:
                results += sim.compare(wl, [r], fleet)
                print(f"{mode} {name} {r}: {results[-1].wall_s:.1f} s", file=sys.stderr)
            if name not in ideals:  # the ideal fleet has no router: the same in every mode
                ideals[name] = simulate_ideal(wl, fleet)
            cmd = "kvroute simulate --workload " + name + (f" {path}" if path else "") + \
                f" --routers {','.join(routers)}" + ("" if mode == "precise" else f" --knowledge {mode}")
            out += [f"### {name}", "", f"{wl.description}; cache {fleet.cache_tokens:,} tokens per replica. "
                    f"Simulated in {time.perf_counter() - t0:.0f} s.", "", f"    {cmd}", "",
                    _table(results + [ideals[name]], _best(results)), "",
                    fraction_text(results, ideals[name]).capitalize() + ".", ""]
            verdict = _verdict(results)
            if verdict:
                out += [verdict, ""]
    out += _scenarios(args.scenario_routers.split(","))
    out += [
        "## Notes on the model",
        "",
        "- Replicas prefill one request at a time (the explainer's model). A request queued behind "
        "its twin on the same replica therefore hits, so round-robin reaches about 50% on "
        "shared-prefix, where SGLang measured 20% on engines that prefill many prompts at once "
        "(which all miss together).",
        "- shared-prefix sends all 1,024 requests at t=0: under precise knowledge no block is "
        "cached before the first prefills finish, so every cache-aware router routes blind and "
        "spreads each group (Dynamo PR #8276); only sticky (hashing the first block) keeps "
        "groups together. Hybrid knowledge (speculative insert-on-route) removes that blindness.",
        "- trace: every request shares block 0, so sticky without sessions (the hash of the first "
        "block) sends everything to one replica (busiest/mean 8.0x): the documented failure.",
        "",
        f"Total generation time {time.perf_counter() - started:.0f} s.", "",
    ]
    Path(args.out).write_text("\n".join(out), encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
