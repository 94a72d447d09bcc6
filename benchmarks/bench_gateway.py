"""kvroute serve against direct-to-engine and the peer gateways, on emulated engines.

Not a pytest benchmark: a script that starts every process itself on free loopback ports,
runs `kvroute bench` against each target and writes a table into docs/results.md (between
the `bench_gateway` markers). Three measurements:

1. Added latency: one emulated engine (time scale 0.001, so the modeled GPU takes ~0), a
   generated Mooncake trace of short unique prompts (600 tokens, 1 output token),
   `kvroute bench --workload trace T --api chat --concurrency 1`; TTFT p50/p99 through each
   gateway minus direct-to-engine TTFT, same run.
2. Maximum request rate on one core: eight engines, the same trace, each gateway pinned to
   CPU 0 with `taskset` (its own threads included), `--concurrency 64`; completed requests
   per second.
   The emulated fleet and the client share the other CPU(s), so they may bound it too: the
   direct-to-engine row shows what one emulated engine process serves alone.
3. Chat: eight engines at real modeled time, a fresh fleet per router (cold caches),
   `kvroute bench --workload chat --api chat --replicas 8 --time-scale 0.25 --duration D`
   (think times and starts compressed 4x); hit rate (cached tokens the engines report over
   prompt tokens) and TTFT p90.

Peers: SGLang's `smg` (policy cache_aware) and `vllm-router` (policy cache_aware), from
PyPI, found on PATH or under --peers-venv. smg rejects token-id prompts ("prompt: data did
not match any variant of untagged enum StringOrArray"), so every run uses the chat API.

Run: python benchmarks/bench_gateway.py [--quick] [--peers-venv /tmp/peers/venv] [--write docs/results.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from docs_section import write_section  # noqa: E402  (scripts/docs_section.py)

SECTION = "bench_gateway"  # its marked section of docs/results.md


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_block(n: int) -> int:
    """A port p with p..p+n-1 all free."""
    for _ in range(200):
        p = free_port()
        if p + n >= 65000:
            continue
        ok = True
        for q in range(p, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no free port block")


def wait_http(url: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def process(args: list[str], log: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pinned(cmd: list[str], cpu: int | None) -> list[str]:
    return (["taskset", "-c", str(cpu)] + cmd) if cpu is not None and shutil.which("taskset") else cmd


class Fleet:
    """`kvroute emulate --replicas N` on free ports."""

    def __init__(self, n: int, time_scale: float, logdir: str) -> None:
        self.n, self.time_scale, self.logdir = n, time_scale, logdir
        self.port = free_block(n)
        self.events = free_block(2 * n)

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + i}" for i in range(self.n)]

    def replica_args(self) -> list[str]:
        out = []
        for i, url in enumerate(self.urls()):
            pub, rep = self.events + 2 * i, self.events + 2 * i + 1
            out += ["--replica", f"{url},events=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep},name=e{i}"]
        return out

    @contextlib.contextmanager
    def run(self) -> Iterator[Fleet]:
        cmd = [sys.executable, "-m", "kvroute.cli", "emulate", "--replicas", str(self.n), "--port", str(self.port),
               "--kv-events-port", str(self.events), "--time-scale", str(self.time_scale)]
        with process(cmd, os.path.join(self.logdir, "emulate.log")):
            for url in self.urls():
                wait_http(url + "/health")
            yield self


def gateways(fleet: Fleet, peers: dict[str, str], cpu: int | None, logdir: str,
             policies: tuple[str, ...] = ("ttft",)) -> list[tuple[str, list[str], str]]:
    """(label, command, base URL) of each gateway in front of `fleet`."""
    out = []
    for policy in policies:
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute.gateway", "--port", str(port), "--policy", policy,
               *fleet.replica_args(), "--log-level", "error"]
        out.append((f"kvroute serve ({policy})", pinned(cmd, cpu), f"http://127.0.0.1:{port}"))
    workers = fleet.urls()
    if "smg" in peers:
        port = free_port()
        cmd = [peers["smg"], "launch", "--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1",
               "--port", str(port), "--disable-tokenizer-autoload", "--prometheus-port", str(free_port()),
               "--log-level", "error"]
        out.append(("smg (cache_aware)", pinned(cmd, cpu), f"http://127.0.0.1:{port}"))
    if "vllm-router" in peers:
        port = free_port()
        cmd = [peers["vllm-router"], "--worker-urls", *workers, "--policy", "cache_aware", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "error"]
        out.append(("vllm-router (cache_aware)", pinned(cmd, cpu), f"http://127.0.0.1:{port}"))
    return out


def bench(url: str, label: str, extra: list[str], replicas: int, logdir: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvroute.cli", "bench", "--url", url, "--label", label, "--api", "chat",
           "--replicas", str(replicas), "--json", *extra]
    with open(os.path.join(logdir, "bench.log"), "ab") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, check=True, timeout=1800)
    return dict(json.loads(out.stdout)["results"][0])


def find_peers(venv: str | None) -> dict[str, str]:
    found = {}
    for name in ("smg", "vllm-router"):
        path = os.path.join(venv, "bin", name) if venv else None
        path = path if path and os.path.exists(path) else shutil.which(name)
        if path:
            found[name] = path
    return found


def with_gateway(cmd: list[str], url: str, logdir: str, label: str) -> contextlib.AbstractContextManager[Any]:
    @contextlib.contextmanager
    def run() -> Iterator[None]:
        with process(cmd, os.path.join(logdir, label.split()[0] + ".log")):
            wait_http(url + "/v1/models" if "kvroute" not in label else url + "/health")
            time.sleep(1.0)  # health checks and event subscriptions settle
            yield

    return run()


def short_trace(path: str, n: int) -> str:
    """A Mooncake trace of n unique 600-token prompts with 1 output token, all at t=0."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1,
                                "hash_ids": [1_000_000 + i]}) + "\n")
    return path


def overhead(args: argparse.Namespace, peers: dict[str, str]) -> list[dict[str, Any]]:
    """Every target in turn, `--rounds` times, all gateways up throughout; per target the
    median over rounds of each figure (machine noise moves whole rounds)."""
    fleet = Fleet(1, 0.001, args.logdir)
    trace = short_trace(os.path.join(args.logdir, "short.jsonl"), args.overhead_requests)
    extra = ["--workload", "trace", trace, "--concurrency", "1"]
    runs: dict[str, list[dict[str, Any]]] = {}
    with fleet.run(), contextlib.ExitStack() as stack:
        targets = [("direct", fleet.urls()[0])]
        for label, cmd, url in gateways(fleet, peers, None, args.logdir):
            stack.enter_context(with_gateway(cmd, url, args.logdir, label))
            targets.append((label, url))
        for _ in range(args.rounds):
            for label, url in targets:
                runs.setdefault(label, []).append(bench(url, label, extra, 1, args.logdir))
    return [_median_row(label, rows) for label, rows in runs.items()]


def _median_row(label: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    out = dict(rows[0], label=label, rounds=len(rows))
    for key in ("ttft_p50", "ttft_p99", "ttft_p90", "e2e_p50", "throughput_rps"):
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["errors"] = sum(r["errors"] for r in rows)
    return out


def max_rate(args: argparse.Namespace, peers: dict[str, str]) -> list[dict[str, Any]]:
    fleet = Fleet(8, 0.001, args.logdir)
    trace = short_trace(os.path.join(args.logdir, "short-rate.jsonl"), args.rate_requests)
    extra = ["--workload", "trace", trace, "--concurrency", "64"]
    rows = []
    with fleet.run():
        rows.append(bench(fleet.urls()[0], "direct (engine 0 only)", extra, 8, args.logdir))
        for label, cmd, url in gateways(fleet, peers, 0, args.logdir):
            with with_gateway(cmd, url, args.logdir, label):
                rows.append(bench(url, label + " [CPU 0]", extra, 8, args.logdir))
    return rows


def chat(args: argparse.Namespace, peers: dict[str, str]) -> list[dict[str, Any]]:
    extra = ["--workload", "chat", "--time-scale", "0.25", "--duration", str(args.chat_duration)]
    rows = []
    probe = Fleet(8, 1.0, args.logdir)
    for label, cmd, url in gateways(probe, peers, None, args.logdir, ("ttft", "round_robin")):
        with probe.run():  # a fresh fleet per router: every run starts with cold caches
            with with_gateway(cmd, url, args.logdir, label):
                rows.append(bench(url, label, extra, 8, args.logdir))
    return rows


def peer_versions(peers: dict[str, str]) -> dict[str, str]:
    """name -> installed version (read with the peer's own interpreter)."""
    out = {}
    for name, path in peers.items():
        python = os.path.join(os.path.dirname(path), "python")
        dist = "smg" if name == "smg" else "vllm-router"
        try:
            out[name] = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version('{dist}'))"],
                                       capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out[name] = "?"
    return out


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def table(over: list[dict[str, Any]], rate: list[dict[str, Any]], chats: list[dict[str, Any]], cmd: str,
          versions: dict[str, str]) -> str:
    peers = ", ".join(f"{k} {v}" for k, v in versions.items()) or "none found"
    lines = ["## Gateway: kvroute serve vs direct and peer gateways", "",
             f"`{cmd}` (benchmarks/bench_gateway.py), on this machine's loopback with emulated engines "
             f"(`kvroute emulate`), {os.cpu_count()} CPUs shared with other work; one run each (the latency "
             f"rounds: medians). Peers: {peers} "
             "(PyPI manylinux abi3 wheels; `pip download --no-deps smg vllm-router` found both, and they install "
             "without torch or CUDA: smg needs setproctitle, grpcio, grpcio-health-checking, pyyaml; vllm-router "
             "needs setproctitle, aiohttp, orjson, uvicorn, fastapi, requests).", "",
             "Added latency per request (1 engine, chat API, 600-token prompts, one request at a time; every "
             "target in turn, repeated; medians over the rounds; added = TTFT through the gateway minus direct "
             "TTFT):", "",
             "| target | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | errors |", "|---|---|---|---|---|---|"]
    directs = [r for r in over if r["label"] == "direct"] or [{"ttft_p50": 0.0, "ttft_p99": 0.0}]
    d50 = sum(r["ttft_p50"] for r in directs) / len(directs)
    d99 = sum(r["ttft_p99"] for r in directs) / len(directs)
    for r in over:
        added = r["label"].startswith("direct")
        r = dict(r, label=f"{r['label']} ({r.get('rounds', 1)} rounds)")
        lines.append(f"| {r['label']} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} | "
                     f"{'-' if added else _ms(r['ttft_p50'] - d50)} | {'-' if added else _ms(r['ttft_p99'] - d99)} | "
                     f"{r['errors']} |")
    lines += ["", "Maximum request rate (8 engines at time scale 0.001, 600-token prompts with 1 output token, "
              "64 requests in flight, each gateway pinned to CPU 0):", "", "| target | requests/s | TTFT p50 ms | errors |", "|---|---|---|---|"]
    for r in rate:
        lines.append(f"| {r['label']} | {r['throughput_rps']:.0f} | {_ms(r['ttft_p50'])} | {r['errors']} |")
    lines += ["", "Chat workload (8 engines, real modeled time, think times compressed 4x, cold caches per "
              "router):", "",
              "| router | requests | hit rate | TTFT p50 ms | TTFT p90 ms | errors |", "|---|---|---|---|---|---|"]
    for r in chats:
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"| {r['label']} | {r['completed']} | {hit} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p90'])} | "
                     f"{r['errors']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers-venv", default=None, help="a virtualenv holding smg and vllm-router")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test of the script)")
    p.add_argument("--overhead-requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3, help="overhead: rounds over all targets (median reported)")
    p.add_argument("--rate-requests", type=int, default=2000)
    p.add_argument("--chat-duration", type=float, default=60.0)
    p.add_argument("--only", choices=("overhead", "rate", "chat"), action="append", default=None,
                   help="run only these measurements (repeatable)")
    p.add_argument("--write", default=None, metavar="MD", help="put the table into this markdown file")
    p.add_argument("--json", default=None, metavar="PATH", help="raw summaries")
    p.add_argument("--logdir", default=None)
    args = p.parse_args()
    if args.quick:
        args.overhead_requests, args.rate_requests, args.chat_duration, args.rounds = 50, 200, 10.0, 1
    args.logdir = args.logdir or os.path.join(ROOT, "build", "bench_gateway")
    os.makedirs(args.logdir, exist_ok=True)
    peers = {} if args.no_peers else find_peers(args.peers_venv)
    print(f"peers: {peers or 'none found'}; logs in {args.logdir}", file=sys.stderr)
    only = set(args.only or ("overhead", "rate", "chat"))
    over = overhead(args, peers) if "overhead" in only else []
    rate = max_rate(args, peers) if "rate" in only else []
    chats = chat(args, peers) if "chat" in only else []
    cmd = "python benchmarks/bench_gateway.py " + " ".join(sys.argv[1:])
    block = table(over, rate, chats, cmd.strip(), peer_versions(peers))
    print(block)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": over, "rate": rate, "chat": chats}, f, indent=2)
    if args.write:
        write_section(args.write, SECTION, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
