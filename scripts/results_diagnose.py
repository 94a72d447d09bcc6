#!/usr/bin/env python3
"""Regenerate the "Fraction of the ideal" and "Scale-out and deploy" section of docs/results.md.

    python scripts/results_diagnose.py [--write] [--trace PATH] [--routers ...] [--scenario-routers ...]

Every policy on each simulator workload (precise knowledge, seed 0, 8 replicas, the
workload's default cache) against the ideal fleet (kvroute.sim.ideal: one shared prefix
cache with the fleet's KV memory, one central FIFO queue), then kvroute.sim.scenarios on
chat: 2 replicas join at 300 s, and every replica restarts at 300 s. Prints the sections
("diagnose-ideal", "diagnose-scenarios"); --write replaces each in docs/results.md between
its markers (scripts/results.py keeps them).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

from kvroute import sim
from kvroute.sim import scenarios
from kvroute.sim.ideal import fraction_of_ideal, simulate_ideal

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "conversation_trace.jsonl"
SECTIONS = ("ideal", "scenarios")
NOTE = ("Not a bound everywhere: on chat at 8 replicas (overloaded: round-robin's p90 TTFT is 23 s) the ideal fleet as modelled does worse than cache-aware and ttft on both hit rate and p90 TTFT. Its replicas share one block pool, so a replica that cannot allocate preempts (recomputes) its own requests while other replicas hold the memory, and running requests of every replica crowd the shared cache; per-replica pools do not interfere that way. A likely cause, not yet measured (engine preemption counts would show it); on shared-prefix and on the conversation trace (`kvroute diagnose`, an earlier revision: ttft at 90% of its hit rate, 95% of its p90 TTFT) it is the limit it should be.")


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0%}"


def _fraction_table(results: list[sim.SimResult], ideal: sim.SimResult) -> list[str]:
    cols = ("router", "hit rate", "of ideal", "p90 TTFT", "of ideal (ideal p90 / its)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for res in results + [ideal]:
        f = fraction_of_ideal(res, ideal)
        lines.append(f"| {res.router} | {res.metrics.hit_rate:.1%} | {_pct(f['hit_rate'])} | "
                     f"{res.metrics.ttft_p90:.2f} s | {_pct(f['ttft_p90'])} |")
    return lines


def _fractions(routers: list[str], trace: str) -> list[str]:
    out = ["## Fraction of the ideal", "",
           "The ideal fleet (kvroute.sim.ideal) pools the replicas' KV memory into one prefix cache and "
           "queues requests centrally: a replica takes the next request while its next step has token "
           "budget left. Each policy's hit rate as a fraction of the ideal's, and the ideal's p90 TTFT over "
           "the policy's (100% = as fast as the ideal; above 100%: a router placement that beat FIFO). "
           "Precise knowledge, 8 replicas, seed 0, the workload's default cache.", "",
           NOTE, ""]
    for name, path in (("chat", None), ("shared-prefix", None), ("trace", trace)):
        if path is not None and not Path(path).exists():
            out += [f"### {name}", "", f"(skipped: {path} not found)", ""]
            continue
        wl = sim.build_workload(name, path=path)
        fleet = sim.fleet_for(name)
        t0 = time.perf_counter()
        ideal = simulate_ideal(wl, fleet)
        results = []
        for r in routers:
            results += sim.compare(wl, [r], fleet)
            print(f"ideal {name} {r}: {results[-1].wall_s:.1f} s", file=sys.stderr)
        cmd = f"kvroute simulate --workload {name}" + (f" {path}" if path else "") + f" --routers {','.join(routers)}"
        out += [f"### {name}", "", f"{wl.description}. Simulated in {time.perf_counter() - t0:.0f} s.", "",
                f"    {cmd}", "", *_fraction_table(results, ideal), ""]
    return out


def _scenarios(routers: list[str]) -> list[str]:
    out = ["## Scale-out and deploy", "",
           "kvroute.sim.scenarios on the chat workload (8 replicas, seed 0, precise knowledge): a change at "
           "300 s. hit before = hit rate of the requests arriving in the 120 s before it; lowest window = "
           "the lowest hit rate of a 60 s window of arrivals after it; recovered after = the end of the "
           "first 60 s window whose hit rate is back to 90% of the one before (windows are noisy by a few "
           "points); new replicas' share = their share of the first window's requests over their share of "
           "the fleet (above 1: a burst to cold replicas), with their p90 TTFT against the old replicas'.",
           ""]
    wl = sim.build_workload("chat")
    fleet = sim.fleet_for("chat")
    for text in ("scale-out@300+2", "deploy@300"):
        sc = scenarios.parse(text)
        rows = []
        t0 = time.perf_counter()
        for r in routers:
            res = scenarios.simulate_scenario(wl, r, fleet, sc)
            rows.append((res, scenarios.measure_recovery(res, sc, fleet.replicas)))
            print(f"scenario {text} {r}: {res.wall_s:.1f} s", file=sys.stderr)
        what = "2 replicas join (8 -> 10)" if sc.kind == "scale-out" else "every replica restarts"
        out += [f"### {sc.kind}: {what} at 300 s", "", f"Simulated in {time.perf_counter() - t0:.0f} s.", "",
                f"    kvroute simulate --routers {','.join(routers)} --scenario {text}", "",
                scenarios.recovery_markdown(rows), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the section in docs/results.md")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--routers", default=",".join(sim.ALL_ROUTERS))
    ap.add_argument("--scenario-routers", default="round-robin,sticky,least-loaded,cache-aware,dynamo,ttft")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="ideal, scenarios or both (default)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    for name in args.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; expected one of {', '.join(SECTIONS)}")
        started = time.perf_counter()
        body = (_fractions(args.routers.split(","), args.trace) if name == "ideal"
                else _scenarios(args.scenario_routers.split(",")))
        _emit(name, body, f"Generated by `python scripts/results_diagnose.py --sections {name} --write` in "
                          f"{time.perf_counter() - started:.0f} s.", args.write)
    return 0


def _emit(name: str, body: list[str], footer: str, write: bool) -> None:
    begin, end = f"<!-- begin: diagnose-{name} -->", f"<!-- end: diagnose-{name} -->"
    section = "\n".join([begin, *body, footer, "", end, ""])
    print(section)
    if write:
        path = ROOT / "docs" / "results.md"
        text = path.read_text(encoding="utf-8")
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end) + "\n?", re.S)
        text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
