"""How many streamed requests one emulated engine serves per second on one core.

The engine runs in its own process (`kvroute emulate`, one engine, pinned to one CPU where
the OS allows), with --time-scale 0.001 so that the engine model's step times do not
bound the rate: what is measured is the emulator's own cost per request (HTTP parsing,
the engine model's scheduling, SSE chunks, KV events). A load generator in this process
keeps CONCURRENCY streamed /v1/completions requests in flight (PROMPT random token ids,
MAX_TOKENS tokens each, stream_options.include_usage) for DURATION seconds.

Reported: requests per wall second and requests per CPU second of the engine process
(the per-core rate; the target is >= 500). The load generator shares the machine, so the
wall rate is a lower bound when cores are scarce.

Run: python -m pytest benchmarks/bench_emulate.py --benchmark-only -s
     python benchmarks/bench_emulate.py            (prints the numbers)
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time

import pytest

CONCURRENCY = 64
PROMPT = 128
MAX_TOKENS = 8
DURATION = 8.0
WARMUP = 1.0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


async def _load(url: str, duration: float) -> tuple[int, int]:
    import aiohttp

    done = errors = 0
    stop = time.perf_counter() + duration
    rng = random.Random(0)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            body = {"prompt": [rng.randrange(1000, 30000) for _ in range(PROMPT)], "max_tokens": MAX_TOKENS,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with session.post("/v1/completions", json=body) as resp:
                ok = resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        break
            done += ok
            errors += not ok

    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return done, errors


def measure(duration: float = DURATION) -> dict[str, float]:
    """Start one emulated engine, load it, return requests per wall and per CPU second."""
    http, events = _free_ports(2)
    cmd = [sys.executable, "-m", "kvroute.cli", "emulate", "--port", str(http), "--kv-events-port", str(events),
           "--time-scale", "0.001"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: _pin(0))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("engine 0"), line
        url = f"http://127.0.0.1:{http}"
        _pin(1)
        asyncio.run(_load(url, WARMUP))
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        done, errors = asyncio.run(_load(url, duration))
        cpu1, t1 = _cpu_seconds(proc.pid), time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(10)
    assert errors == 0
    return {"requests": done, "wall_s": t1 - t0, "engine_cpu_s": cpu1 - cpu0,
            "per_wall_s": done / (t1 - t0), "per_cpu_s": done / max(cpu1 - cpu0, 1e-9)}


@pytest.mark.parametrize("impl", ["native"])
def test_streamed_requests_per_second(benchmark, impl):
    """One engine, streamed completions: the >= 500 requests per CPU second target."""
    benchmark.group = f"emulate: {CONCURRENCY} streams, {PROMPT}-token prompts, {MAX_TOKENS} tokens each"
    out = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(out)
    print(f"\n{out['requests']} requests: {out['per_wall_s']:.0f}/s wall, {out['per_cpu_s']:.0f}/s per engine "
          f"CPU second ({out['engine_cpu_s']:.2f} s CPU over {out['wall_s']:.2f} s)")
    assert out["requests"] > 0


if __name__ == "__main__":
    res = measure()
    print(f"{res['requests']} requests: {res['per_wall_s']:.0f}/s wall, {res['per_cpu_s']:.0f}/s per engine CPU "
          f"second ({res['engine_cpu_s']:.2f} s CPU over {res['wall_s']:.2f} s)")
