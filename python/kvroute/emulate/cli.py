"""`kvroute emulate`: arguments and the main loop (one process, one event loop).

Engine parameters are EngineConfig's own fields (kvroute.sim.engine), one flag each
(`--max-num-seqs`, ...), so the CLI cannot drift from the engine model; --block-size and
--kv-blocks are the two every user sets.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from typing import Any

_OWN = {"block_size", "num_kv_blocks"}  # --block-size, --kv-blocks
ENDPOINTS = "POST /v1/completions /v1/chat/completions /tokenize; GET /v1/models /health /metrics"


def _engine_fields() -> list[Any]:
    try:
        from ..sim.engine import EngineConfig
    except ImportError:  # the engine model is missing: the command will say so when run
        return []
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in _OWN]


def _bool(text: str) -> bool:
    """true/false/1/0 (argparse names this function in its message on a bad value)."""
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise ValueError(text)
    return value


def _kind(f: Any) -> Any:
    t = str(f.type)
    if "bool" in t:
        return _bool
    if "int" in t and "float" not in t:
        return int
    if "float" in t:
        return float
    return str


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `kvroute emulate`."""
    p.add_argument("--port", type=int, default=8001, help="HTTP port of engine 0; engine i uses port+i")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--replicas", type=int, default=1, help="number of engines (default 1)")
    p.add_argument("--kv-events-port", type=int, default=5557,
                   help="KV-event PUB port of engine 0; engine i publishes on port+2i, replays on port+2i+1")
    p.add_argument("--model", default="kvroute-emulated", help="served model name")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a Hugging Face tokenizer.json or its folder (default: built-in byte-level)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV cache blocks per engine (default: the engine model's)")
    p.add_argument("--encoding", choices=("maps", "arrays"), default="maps",
                   help="KV event encoding: tagged maps (vLLM >= 0.25) or positional arrays")
    p.add_argument("--topic", default="", help="KV event topic (vLLM's default is empty)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per engine second (0.1 runs the engines 10x faster)")
    p.add_argument("--max-model-len", type=int, default=131_072)
    g = p.add_argument_group("engine model parameters (kvroute.sim.engine.EngineConfig)")
    taken = {opt for action in p._actions for opt in action.option_strings}
    for f in _engine_fields():
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:
            flag = "--engine-" + f.name.replace("_", "-")  # e.g. the engine's `model` (cost source)
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = _kind(f)
        metavar = {int: "N", float: "X"}.get(kind, "BOOL" if "bool" in str(f.type) else "TEXT")
        g.add_argument(flag, dest="engine_" + f.name, type=kind, default=None, metavar=metavar,
                       help=f"default {default!r}")


def options(args: argparse.Namespace) -> Any:
    """EmulatorOptions from parsed arguments."""
    from .fleet import EmulatorOptions

    engine: dict[str, Any] = {"block_size": args.block_size}
    if args.kv_blocks is not None:
        engine["num_kv_blocks"] = args.kv_blocks
    for key, value in vars(args).items():
        if key.startswith("engine_") and value is not None:
            engine[key[len("engine_"):]] = value
    return EmulatorOptions(host=args.host, model=args.model, tokenizer=args.tokenizer, engine=engine,
                           time_scale=args.time_scale, encoding=args.encoding, topic=args.topic,
                           max_model_len=args.max_model_len)


def _check(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    last_http = args.port + args.replicas - 1
    last_events = args.kv_events_port + 2 * args.replicas - 1
    for name, lo, hi in (("--port", args.port, last_http), ("--kv-events-port", args.kv_events_port, last_events)):
        if lo < 1 or hi > 65535:
            raise ValueError(f"{name}: ports {lo}..{hi} are not all valid TCP ports")
    if not (args.port > last_events or last_http < args.kv_events_port):
        raise ValueError(f"--port {args.port}..{last_http} overlaps --kv-events-port "
                         f"{args.kv_events_port}..{last_events}")


async def _main(args: argparse.Namespace) -> int:
    from .fleet import EnginePorts, Fleet

    fleet = Fleet(EnginePorts.consecutive(args.port, args.kv_events_port, args.replicas), options(args))
    await fleet.start()
    for e in fleet.engines:
        print(f"engine {e.index}: {e.url}  events {e.events_endpoint}  replay {e.replay_endpoint}  ({ENDPOINTS})")
    print("kvroute serve " + " ".join(f"--replica {e.serve_args()}" for e in fleet.engines))
    print("Ctrl-C stops all engines.", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(fleet.wait())
    await asyncio.wait([waiter, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    await fleet.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    """`kvroute emulate`: start the engines, serve until Ctrl-C."""
    import zmq

    _check(args)
    try:
        return _run_loop(args)
    except (OSError, zmq.ZMQError) as exc:
        # A port in use or an address that cannot be bound: say which, no traceback.
        raise ValueError(f"cannot listen: {exc}") from None


def _run_loop(args: argparse.Namespace) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the emulate extra
        return asyncio.run(_main(args))
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_main(args))
    uvloop.install()  # pragma: no cover - Python 3.10
    return asyncio.run(_main(args))


__all__ = ["ENDPOINTS", "add_arguments", "options", "run"]
