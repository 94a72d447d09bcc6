"""`kvroute bench`: arguments, the runs (one per --url), the table/JSON/plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .client import APIS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `kvroute bench`."""
    p.add_argument("--url", action="append", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8001 (repeat to compare servers)")
    p.add_argument("--label", action="append", default=None, help="row name per --url (default: the URL)")
    p.add_argument("--spread", action="store_true",
                   help="one run whose requests go round-robin over every --url (several gateways, one fleet)")
    p.add_argument("--workload", nargs="+", default=["chat"], metavar="NAME",
                   help="chat (default), shared-prefix, or trace PATH (a Mooncake JSONL trace)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests per second")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, default=None, help="send at most this many requests")
    stop.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--api", choices=APIS, default="completions",
                   help="completions: token-id prompts (exact); chat: rendered messages")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    p.add_argument("--replicas", type=int, default=4, help="chat: size the workload for this many replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the workload's start and think times (and trace timestamps) by this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw TTFT CDFs, one line per server")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")


def _workload(args: argparse.Namespace) -> Any:
    from .. import sim

    name, path = sim.workload_arg(args.workload)
    # Trace timestamps are scaled by the workload itself; the client scales the others.
    return sim.build_workload(name, path=path, replicas=args.replicas, seed=args.seed,
                              time_scale=args.time_scale)


def run(args: argparse.Namespace) -> int:
    """`kvroute bench`: replay the workload against every --url in turn (or, with --spread,
    once over all of them round-robin)."""
    from . import client, report

    labels = args.label or []
    if len(labels) > len(args.url):
        raise ValueError("more --label than --url")
    wl = _workload(args)
    scale = 1.0 if args.workload[0] == "trace" else args.time_scale
    runs = []
    summaries = []
    targets = [(args.url[0], tuple(args.url[1:]))] if args.spread else [(u, ()) for u in args.url]
    for i, (url, spread) in enumerate(targets):
        cfg = client.BenchConfig(url=url, api=args.api, model=args.model, rate=args.rate,
                                 concurrency=args.concurrency, requests=args.requests, duration=args.duration,
                                 time_scale=scale, seed=args.seed, timeout=args.timeout, spread=spread)
        label = labels[i] if i < len(labels) else "+".join((url, *spread))
        results, wall = _run_one(cfg, wl, label, args)
        runs.append((label, results))
        summaries.append(report.summarize(label, results, wall))
    if args.plot:
        report.plot_ttft(runs, args.plot, f"{wl.description}; {args.api}")
    if args.json:
        print(json.dumps({"workload": {"name": wl.name, "description": wl.description}, "api": args.api,
                          "results": [s.as_dict() for s in summaries]}, indent=2))
    else:
        print(f"{wl.description}; /v1/{'chat/completions' if args.api == 'chat' else 'completions'}, streamed")
        print(report.text_table(summaries))
        if args.plot:
            print(f"TTFT CDFs: {args.plot}")
    return 0


def _run_one(cfg: Any, wl: Any, label: str, args: argparse.Namespace) -> tuple[list[Any], float]:
    from . import client

    show = (not args.json and sys.stderr.isatty()) or args.progress
    if not show:
        return asyncio.run(client.run(cfg, wl))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = min(wl.num_requests, cfg.requests) if cfg.requests else wl.num_requests
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label[:24], total=total)
        return asyncio.run(client.run(cfg, wl, progress=lambda done, _t: bar.update(task, completed=done)))


__all__ = ["add_arguments", "run"]
