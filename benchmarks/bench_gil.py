"""route() next to a busy Python thread: the GIL convoy that cpp/bindings/gil.hpp avoids.

A gateway routes on its event loop while other threads run Python (the KV-event subscriber,
the Redis link, the snapshot writer). A native call that releases the GIL must win it back,
and a thread running Python hands it over only when the switch interval
(sys.getswitchinterval(), 5 ms) forces it to. So a 3 us route() that releases the GIL can
take 5 ms. kvroute's calls keep the GIL unless their work is long (gil.hpp).

Each timed call is route() and finish() of an 8,192-token prompt on a ttft router with
8 replicas, then a few microseconds of Python (a gateway's own work between two routes:
without it the busy thread, woken when the GIL is let go, is too slow to take it before
route() takes it back, and the benchmark would hide the convoy). A round is 200 calls:
the convoy makes a few calls in a hundred wait ~5 ms, which a median over single calls
would not show, and the median over rounds does. Cases:
- "alone": no other thread;
- "busy thread": another thread spins a pure-Python loop the whole time, with the GIL
  kept for short calls, as shipped (native) and pure Python (reference);
- "busy thread, GIL released": native with every call releasing the GIL
  (_native._release_gil_always(True), what route() did before gil.hpp).

Run: python benchmarks/report.py benchmarks/bench_gil.py
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import kvroute._native as native
import kvroute.reference as reference
from kvroute.config import RouterConfig

IMPLS = {"native": native, "reference": reference}
PROMPT = np.random.default_rng(5).integers(0, 128_000, 8192).astype(np.int32)


@pytest.fixture
def busy_thread() -> Iterator[None]:
    """Another thread that runs Python without pause until the benchmark ends."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            x = 0
            for i in range(1000):
                x += i

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()


def _bench(benchmark, mod):
    d = benchmark.pedantic(_route_once(mod), rounds=15, iterations=200, warmup_rounds=1)
    assert d.prompt_tokens == 8192


def _route_once(mod):
    r = mod.Router(RouterConfig(policy="ttft", block_size=16), [f"r{i}" for i in range(8)])

    def once():
        d = r.route(PROMPT)
        r.finish(d.handle)
        x = 0
        for i in range(200):  # the caller's own Python between two routes
            x += i
        return d

    return once


@pytest.mark.parametrize("impl", list(IMPLS))
def test_route_alone(benchmark, impl):
    benchmark.group = "route 8192 tokens, no other thread"
    _bench(benchmark, IMPLS[impl])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.usefixtures("busy_thread")
def test_route_beside_a_busy_thread(benchmark, impl):
    benchmark.group = "route 8192 tokens, beside a busy Python thread"
    _bench(benchmark, IMPLS[impl])


@pytest.mark.usefixtures("busy_thread")
def test_route_beside_a_busy_thread_gil_released(benchmark):
    benchmark.group = "route 8192 tokens, beside a busy Python thread"
    native._release_gil_always(True)
    try:
        _bench(benchmark, native)
    finally:
        native._release_gil_always(False)
