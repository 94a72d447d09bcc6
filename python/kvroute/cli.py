"""The `kvroute` command line."""

from __future__ import annotations

import argparse
import sys

import numpy as np

import kvroute


def _cmd_hash(args: argparse.Namespace) -> int:
    tokens = np.array([int(t) for t in args.tokens.replace(",", " ").split()], dtype=np.int64)
    hashes = kvroute.block_hashes(tokens, args.block_size, salt=args.salt)
    print(f"{len(tokens)} tokens, block size {args.block_size}, {len(hashes)} full blocks "
          f"({kvroute.implementation} implementation)")
    for i, h in enumerate(hashes):
        print(f"block {i:4d}  {int(h):#018x}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from . import sim
    from .sim import report
    from .sim.ideal import fraction_of_ideal, fraction_text, simulate_ideal

    name, path = sim.workload_arg(args.workload)
    specs = [sim.router_spec(r) for r in args.routers.split(",") if r.strip()]
    if not specs:
        raise ValueError("--routers names no router")
    fleet = sim.fleet_for(name, replicas=args.replicas, seed=args.seed, knowledge=args.knowledge,
                          event_delay=args.event_delay, cache_tokens=args.cache_tokens,
                          prefill_rate=args.prefill_rate)
    rate = args.rate
    if args.sweep and name == "shared-prefix" and rate is None:
        rate = sim.SWEEP_SHARED_PREFIX_RATE  # a sweep scales arrivals: all-at-once has none to scale
    workload = sim.build_workload(name, path=path, replicas=args.replicas, seed=args.seed,
                                  time_scale=args.time_scale, rate=rate)
    if args.scenario:
        return _run_scenario(args, workload, fleet, specs)
    if args.sweep:
        return _sweep(args, workload, specs, fleet)
    results = []
    show = not args.json and sys.stderr.isatty() or args.progress
    if show:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            tasks = {s.name: bar.add_task(s.name, total=workload.num_requests) for s in specs}
            for spec in specs:
                results += sim.compare(workload, [spec], fleet,
                                       progress=lambda n, done, total: bar.update(tasks[n], completed=done))
    else:
        results = sim.compare(workload, specs, fleet)
    context = {
        "workload": {"name": workload.name, "description": workload.description,
                     "requests": workload.num_requests, "input_tokens": workload.input_tokens,
                     "block_tokens": workload.block_tokens},
        "fleet": {k: getattr(fleet, k) for k in fleet.__dataclass_fields__},
        "implementation": kvroute.implementation,
    }
    if args.plot:
        report.plot(results, args.plot, f"{workload.description}; {fleet.replicas} replicas, {fleet.knowledge}")
    ideal = simulate_ideal(workload, fleet) if args.ideal else None
    if args.json:
        out = report.as_json(results, **context)
        if ideal is not None:
            out["ideal"] = ideal.as_dict()
            for r, res in zip(out["results"], results):
                r["fraction_of_ideal"] = fraction_of_ideal(res, ideal)
        print(json.dumps(out, indent=2))
    else:
        print(f"{workload.description}; {fleet.replicas} replicas, {fleet.knowledge} knowledge "
              f"({kvroute.implementation} implementation)")
        print(report.text_table(results + ([ideal] if ideal is not None else [])))
        if ideal is not None:
            print(fraction_text(results, ideal))
        if args.plot:
            print(f"per-replica prefill seconds: {args.plot}")
    return 0


def _run_scenario(args: argparse.Namespace, workload: object, fleet: object, specs: list) -> int:
    import json

    from .sim import scenarios

    sc = scenarios.parse(args.scenario)
    rows = []
    for spec in specs:
        res = scenarios.simulate_scenario(workload, spec, fleet, sc,  # type: ignore[arg-type]
                                          slow_start_s=args.slow_start)
        rows.append((res, scenarios.measure_recovery(res, sc, fleet.replicas)))  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps({"scenario": sc.__dict__, "results": [{**res.as_dict(), "recovery": r.as_dict()}
                                                               for res, r in rows]}, indent=2))
    else:
        what = (f"{sc.add} replicas join at {sc.at_s:g} s" if sc.kind == "scale-out"
                else f"every replica restarts at {sc.at_s:g} s")
        print(f"{workload.description}; {fleet.replicas} replicas, {what} (60 s windows)")  # type: ignore[attr-defined]
        print(scenarios.recovery_text(rows))
    return 0


def _sweep(args: argparse.Namespace, workload: object, specs: list, fleet: object) -> int:
    import json

    from . import sim
    from .sim import report

    sweeps = []
    for spec in specs:
        def note(pt: object, name: str = spec.name) -> None:
            print(f"{name}: rate x{pt.scale:.3g} ({pt.arrival_rate:.3f}/s) p90 TTFT {pt.ttft_p90:.2f} s",  # type: ignore[attr-defined]
                  file=sys.stderr)
        sweeps.append(sim.sweep(workload, spec, fleet, slo=args.slo, start=args.sweep_start, tol=args.sweep_tol,
                                progress=note if args.progress or sys.stderr.isatty() else None))
    ideal = None
    if args.ideal:
        from .sim.ideal import goodput_fraction, goodput_text, sweep_ideal

        ideal = sweep_ideal(workload, fleet, slo=args.slo, start=args.sweep_start,  # type: ignore[arg-type]
                            progress=note if args.progress or sys.stderr.isatty() else None)
    title = f"{workload.description}; {fleet.replicas} replicas, {fleet.knowledge}"  # type: ignore[attr-defined]
    if args.plot:
        shown = sweeps + ([ideal] if ideal is not None else [])
        base = [sw.at(args.sweep_start).result for sw in shown]  # type: ignore[union-attr]
        report.plot(base, args.plot, title, sweeps=shown)
    if args.json:
        out = {"workload": workload.description, "slo": args.slo,  # type: ignore[attr-defined]
               "sweeps": [sw.as_dict() for sw in sweeps]}
        if ideal is not None:
            out["ideal"] = ideal.as_dict()
            for d, sw in zip(out["sweeps"], sweeps):
                d["goodput_fraction_of_ideal"] = goodput_fraction(sw, ideal)
        print(json.dumps(out, indent=2))
    else:
        print(f"{title}; goodput = highest arrival rate with p90 TTFT <= {args.slo:g} s")
        print(report.sweep_table(sweeps + ([ideal] if ideal is not None else [])))
        if ideal is not None:
            print(goodput_text(sweeps, ideal))
        if args.plot:
            print(f"p90 TTFT vs arrival rate and per-replica prefill seconds: {args.plot}")
    return 0


def _cmd_emulate(args: argparse.Namespace) -> int:
    from .emulate import cli as emulate_cli

    return emulate_cli.run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cli as bench_cli

    return bench_cli.run(args)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import json
    import os

    from .diagnose import report
    from .diagnose.stream import read_jsonl

    if not os.path.exists(args.trace):
        raise ValueError(f"trace file {args.trace!r} does not exist")
    trace = read_jsonl(args.trace, args.format, block_size=args.block_size, limit=args.limit)
    decode = None
    if args.format == "tokens":
        from .tokenize import load_tokenizer

        decode = load_tokenizer(args.tokenizer).decode
    params = report.DiagnoseParams(replicas=args.replicas, cache_tokens=args.cache_tokens, router=args.router,
                                   simulate=not args.no_simulate, decode=decode)
    say = (lambda msg: print(f"kvroute diagnose: {msg}...", file=sys.stderr)) if sys.stderr.isatty() else None
    result = report.diagnose(trace, params, progress=say)
    if args.plot:
        report.plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report.render_text(result))
        if args.plot:
            print(f"miss-ratio curve: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=kvroute.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvroute {kvroute.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_hash = sub.add_parser("hash", help="print the chained block hashes of a token list")
    p_hash.add_argument("tokens", nargs="?", default=" ".join(str(t) for t in range(100)),
                        help="token ids separated by spaces or commas (default 0..99)")
    p_hash.add_argument("--block-size", type=int, default=16)
    p_hash.add_argument("--salt", default=None)
    p_hash.set_defaults(func=_cmd_hash)
    p_sim = sub.add_parser("simulate", help="compare routers on a simulated fleet (kvroute.sim)")
    p_sim.add_argument("--workload", nargs="+", default=["chat"], metavar="NAME",
                       help="chat (default), shared-prefix, or trace PATH (a Mooncake JSONL trace)")
    p_sim.add_argument("--routers", default=",".join(_default_routers()),
                       help="comma-separated router names (default: %(default)s)")
    p_sim.add_argument("--replicas", type=int, default=8)
    p_sim.add_argument("--seed", type=int, default=0)
    p_sim.add_argument("--knowledge", default="precise", choices=("precise", "approximate", "hybrid"),
                       help="what the router knows of the caches (default: precise)")
    p_sim.add_argument("--event-delay", type=float, default=0.0, help="seconds before the router sees a cache change")
    p_sim.add_argument("--cache-tokens", type=int, default=None,
                       help="KV cache per replica in tokens (default: per workload, kvroute.sim.CACHE_TOKENS)")
    p_sim.add_argument("--prefill-rate", type=float, default=None,
                       help="prefill tokens per second per replica (the engine's 1 / per_token_s; default 10,000)")
    p_sim.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times by this")
    p_sim.add_argument("--rate", type=float, default=None, help="shared-prefix: requests per second (default: all at t=0)")
    p_sim.add_argument("--sweep", action="store_true",
                       help="find each router's goodput: the highest arrival rate with p90 TTFT within --slo "
                            "(kvroute.sim.sweep: a doubling ladder from --sweep-start, then bisection to --sweep-tol)")
    p_sim.add_argument("--slo", type=float, default=2.0, help="p90 TTFT SLO in seconds for --sweep (default 2)")
    p_sim.add_argument("--sweep-start", type=float, default=1.0,
                       help="arrival-rate factor the sweep starts from (default 1: the workload as is)")
    p_sim.add_argument("--sweep-tol", type=float, default=0.01,
                       help="relative resolution of the goodput's rate factor (default 0.01: within 1%%)")
    p_sim.add_argument("--json", action="store_true", help="print the results as JSON")
    p_sim.add_argument("--plot", metavar="FILE.png",
                       help="draw per-replica prefill seconds per router (with --sweep, beside p90 TTFT vs rate)")
    p_sim.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p_sim.add_argument("--ideal", action=argparse.BooleanOptionalAction, default=True,
                       help="also run the ideal fleet (kvroute.sim.ideal: one shared prefix cache, one central "
                            "queue) and print each router as a fraction of it (default; it costs about 1.6 routers' "
                            "CPU time: --no-ideal skips it)")
    p_sim.add_argument("--scenario", default=None, metavar="KIND@T[+N]",
                       help="deploy@300 (every replica restarts at 300 s) or scale-out@300+2 (2 replicas join): "
                            "hit-rate recovery per router")
    p_sim.add_argument("--slow-start", type=float, default=0.0, metavar="S",
                       help="with --scenario scale-out: new replicas ramp in over S seconds (default 0: at once)")
    p_sim.set_defaults(func=_cmd_simulate)
    p_emu = sub.add_parser("emulate", help="run emulated vLLM engines on the engine model (kvroute.emulate)")
    _emulate_args(p_emu)
    p_emu.set_defaults(func=_cmd_emulate)
    p_bench = sub.add_parser("bench", help="replay a workload against OpenAI-compatible servers (kvroute.bench)")
    _bench_args(p_bench)
    p_bench.set_defaults(func=_cmd_bench)
    p_serve = sub.add_parser("serve", help="an OpenAI-compatible gateway that routes with kvroute (kvroute[gateway])")
    from .gateway.config import add_arguments

    add_arguments(p_serve)
    p_serve.set_defaults(func=_cmd_serve)
    p_diag = sub.add_parser("diagnose", help="why a trace's prefix-cache hit rate is what it is (kvroute.diagnose)")
    p_diag.add_argument("trace", help="a Mooncake JSONL trace, or a JSONL of token-id prompts (--format tokens)")
    p_diag.add_argument("--format", default="mooncake", choices=("mooncake", "tokens"))
    p_diag.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default: 512 for mooncake, 16 for tokens)")
    p_diag.add_argument("--replicas", type=int, default=8)
    p_diag.add_argument("--cache-tokens", type=int, default=None, help="KV cache per replica in tokens")
    p_diag.add_argument("--router", default="ttft", help="the router whose placements split the cache (default ttft)")
    p_diag.add_argument("--tokenizer", default=None, help="tokenizer folder for the volatile-prefix text (default: bytes)")
    p_diag.add_argument("--limit", type=int, default=None, help="read only the first N requests")
    p_diag.add_argument("--no-simulate", action="store_true", help="skip the simulated replay (TTFT, ideal, split)")
    p_diag.add_argument("--plot", metavar="FILE.png", help="draw the miss-ratio curves")
    p_diag.add_argument("--json", action="store_true", help="print every number as JSON")
    p_diag.set_defaults(func=_cmd_diagnose)
    return parser


def _emulate_args(p: argparse.ArgumentParser) -> None:
    from .emulate.cli import add_arguments

    add_arguments(p)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from .bench.cli import add_arguments

    add_arguments(p)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .gateway.server import main as serve_main

    return serve_main(args)


def _default_routers() -> tuple[str, ...]:
    from .sim.routers import DEFAULT_ROUTERS

    return DEFAULT_ROUTERS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        print(f"kvroute: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
