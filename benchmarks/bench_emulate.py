"""How many streamed requests one emulated engine serves per second on one core.

The engine runs in its own process (`kvroute emulate`, one engine, pinned to one CPU where
the OS allows) with --time-scale 0.001, so that the modeled GPU's step times do not bound
the rate and what is measured is the emulator's own cost per request: HTTP parsing, the
engine model's scheduling, SSE chunks, KV events. (In real time the engine model's
Llama-3.1-8B/A100 prefills ~10,000 tokens/s, i.e. at most ~78 requests/s of 128 tokens:
that is the modeled GPU's limit, not the emulator's.) CLIENTS load-generator processes keep CONCURRENCY
streamed /v1/completions requests in flight between them (PROMPT random token ids,
MAX_TOKENS tokens each, stream_options.include_usage) for DURATION seconds.

Reported: requests per wall second, and requests per CPU second of the engine process
(what one fully busy core would serve). The target is >= 500 streamed requests per
second on one core. The load generators share the machine, so on a small or busy host
the wall rate is bounded by them (the per-CPU-second rate is not).

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

CONCURRENCY = 128
CLIENTS = 2
PROMPT = 128
MAX_TOKENS = 8
DURATION = 8.0
WARMUP = 1.0


def _free_ports(n: int) -> list[int]:
    """n consecutive free ports (kvroute emulate's events and replay ports are p and p+1)."""
    while True:
        socks = [socket.socket()]
        socks[0].bind(("127.0.0.1", 0))
        base = socks[0].getsockname()[1]
        try:
            for k in range(1, n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", base + k))
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(cpu: int) -> None:
    # The engine gets one core; the load generators may use the others.
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def _client(args: tuple[str, float, int, int]) -> tuple[int, int]:
    url, duration, concurrency, seed = args
    return asyncio.run(_load(url, duration, concurrency, seed))


def _load_all(url: str, duration: float, clients: int) -> tuple[int, int]:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(clients) as pool:
        parts = pool.map(_client, [(url, duration, CONCURRENCY // clients, k) for k in range(clients)])
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


async def _load(url: str, duration: float, concurrency: int, seed: int) -> tuple[int, int]:
    import aiohttp

    done = errors = 0
    stop = time.perf_counter() + duration
    rng = random.Random(seed)

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
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done, errors


def measure(duration: float = DURATION, time_scale: float = 0.001, clients: int = CLIENTS) -> dict[str, float]:
    """Start one emulated engine, load it, return requests per wall and per CPU second."""
    http = _free_ports(1)[0]
    events = _free_ports(2)[0]
    cmd = [sys.executable, "-m", "kvroute.cli", "emulate", "--port", str(http), "--kv-events-port", str(events),
           "--time-scale", str(time_scale)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: _pin(0))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("engine 0"), line
        url = f"http://127.0.0.1:{http}"
        _load_all(url, WARMUP, clients)
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        done, errors = _load_all(url, duration, clients)
        cpu1, t1 = _cpu_seconds(proc.pid), time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert errors == 0
    return {"requests": done, "wall_s": t1 - t0, "engine_cpu_s": cpu1 - cpu0,
            "per_wall_s": done / (t1 - t0), "per_cpu_s": done / max(cpu1 - cpu0, 1e-9)}


@pytest.mark.parametrize("time_scale", [0.001])
def test_streamed_requests_per_second(benchmark, time_scale):
    """One engine, streamed completions: the >= 500 requests per second target."""
    benchmark.group = f"emulate: {CONCURRENCY} streams, {PROMPT}-token prompts, {MAX_TOKENS} tokens, " \
                      f"time scale {time_scale:g}"
    out = benchmark.pedantic(measure, kwargs={"time_scale": time_scale}, rounds=1, iterations=1)
    benchmark.extra_info.update(out)
    print(f"\n{out['requests']} requests: {out['per_wall_s']:.0f}/s wall, {out['per_cpu_s']:.0f}/s per engine "
          f"CPU second ({out['engine_cpu_s']:.2f} s CPU over {out['wall_s']:.2f} s)")
    assert out["requests"] > 0


if __name__ == "__main__":
    for scale in (0.001,):
        res = measure(time_scale=scale)
        print(f"time scale {scale:g}: {res['requests']} requests: {res['per_wall_s']:.0f}/s wall, "
              f"{res['per_cpu_s']:.0f}/s per engine CPU second ({res['engine_cpu_s']:.2f} s CPU over "
              f"{res['wall_s']:.2f} s)")
