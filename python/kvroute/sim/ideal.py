"""The ideal fleet: the limit no router can beat at the same size.

One shared prefix cache with the fleet's total KV memory (replicas x cache_tokens, one
kvroute.PrefixIndex of that many blocks), and one central FIFO queue from which any idle
replica takes the next request. Every other part is the fleet model's (kvroute.sim.fleet,
FleetParams): a request's prefill takes uncached tokens / prefill_rate + prefill_overhead
on the replica that took it; its prompt's blocks enter the cache when its prefill
finishes (its first token), its output's when it completes; decode runs beside prefill.
No request waits while a replica is idle, and none misses a prefix that any replica has
cached: a router that places requests on N separate caches can only split the cache and
queue behind a busy replica. Not a strict bound on every run: LRU is not an optimal
replacement policy, so splitting the cache can, rarely, keep a block that one pooled LRU
evicts (a fraction above 1 then shows it), and a scheduler that reorders the queue by
cache could beat FIFO on TTFT; FIFO and LRU are what engines run.

`kvroute simulate` and docs/results.md show each router as a fraction of it:
hit rate / ideal hit rate, ideal p90 TTFT / p90 TTFT (1.0 = as fast as the ideal).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from typing import Any

import numpy as np

from .._backend import backend
from . import metrics as _metrics
from .fleet import FleetParams, Record, SimResult
from .workloads import Workload

_ARRIVE, _PREFILL_END, _DECODE_END = range(3)


def simulate_ideal(workload: Workload, fleet: FleetParams | None = None, *, impl: Any = None) -> SimResult:
    """Run `workload` on the ideal fleet of fleet.replicas replicas (see the module
    docstring). Records carry the replica that served each request."""
    fleet = fleet or FleetParams()
    started, cpu_started = time.perf_counter(), time.process_time()
    n = fleet.replicas
    bt = workload.block_tokens
    cache = (impl or backend).PrefixIndex(1, capacity=fleet.cache_blocks(bt) * n)
    rate, overhead, tpot = float(fleet.prefill_rate), float(fleet.prefill_overhead), float(fleet.time_per_output_token)
    clients = workload.clients
    heap: list[tuple[float, int, int, Any]] = [(float(c.start), i, _ARRIVE, (i, 0))
                                               for i, c in enumerate(clients) if c.turns]
    heapq.heapify(heap)
    seq = len(heap)
    queue: deque[list[Any]] = deque()
    idle = list(range(n))  # a heap: the lowest idle replica takes the next request
    rows: list[list[Any]] = []  # client, turn, arrival, replica, start, cached, ttft, prefill_s
    now = 0.0

    def start(row: list[Any], t: float) -> None:
        nonlocal seq
        turn = clients[row[0]].turns[row[1]]
        m = int(cache.match(turn.hashes)[0])
        if m:
            cache.touch(0, turn.hashes[:m], t)
        row[3], row[4] = heapq.heappop(idle), t
        row[5] = min(m * bt, turn.prompt_tokens)
        row[7] = (turn.prompt_tokens - row[5]) / rate + overhead
        heapq.heappush(heap, (t + row[7], seq, _PREFILL_END, row))
        seq += 1

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == _ARRIVE:
            row = [payload[0], payload[1], now, -1, math.nan, 0, math.nan, 0.0]
            rows.append(row)
            queue.append(row)
        elif kind == _PREFILL_END:
            turn = clients[payload[0]].turns[payload[1]]
            payload[6] = now - payload[2]
            cache.insert(0, turn.hashes, now)
            heapq.heappush(idle, payload[3])
            heapq.heappush(heap, (now + turn.output_tokens * tpot, seq, _DECODE_END, payload))
            seq += 1
        else:
            client = clients[payload[0]]
            cache.insert(0, client.turns[payload[1]].after_hashes, now)
            if payload[1] + 1 < len(client.turns):
                nxt = client.turns[payload[1] + 1]
                heapq.heappush(heap, (now + nxt.think_time, seq, _ARRIVE, (payload[0], payload[1] + 1)))
                seq += 1
        # Same-time events first, so a replica freed at t takes the longest-waiting request.
        while queue and idle and not (heap and heap[0][0] == now):
            start(queue.popleft(), now)
    return _result(workload, fleet, rows, now, started, cpu_started)


def _result(workload: Workload, fleet: FleetParams, rows: list[list[Any]], now: float, started: float,
            cpu_started: float) -> SimResult:
    clients = workload.clients
    col = list(zip(*rows)) if rows else [()] * 8
    turns = [clients[c].turns[k] for c, k in zip(col[0], col[1])]
    rec = Record(
        client=np.array(col[0], dtype=np.int64), turn=np.array(col[1], dtype=np.int64),
        first=np.array([t.first for t in turns], dtype=bool), arrival=np.array(col[2], dtype=np.float64),
        replica=np.array(col[3], dtype=np.int64), start=np.array(col[4], dtype=np.float64),
        prompt_tokens=np.array([t.prompt_tokens for t in turns], dtype=np.int64),
        cached_tokens=np.array(col[5], dtype=np.int64),
        predicted_cached_tokens=np.array(col[5], dtype=np.int64),
        ttft=np.array(col[6], dtype=np.float64), prefill_s=np.array(col[7], dtype=np.float64),
    )
    m = _metrics.compute(prompt_tokens=rec.prompt_tokens, cached_tokens=rec.cached_tokens, ttft=rec.ttft,
                         first_turn=rec.first, replica=rec.replica, prefill_s=rec.prefill_s,
                         num_replicas=fleet.replicas, makespan_s=now)
    return SimResult("ideal", workload.name, m, rec, {}, time.perf_counter() - started,
                     time.process_time() - cpu_started)


def fraction_of_ideal(result: SimResult, ideal: SimResult) -> dict[str, float]:
    """A run as a fraction of the ideal: hit_rate (its / ideal's), ttft_p90 and
    ttft_mean (ideal's / its: 1.0 = as fast as the ideal), each nan when undefined."""
    a, b = result.metrics, ideal.metrics

    def ratio(x: float, y: float) -> float:
        return x / y if y and not (math.isnan(x) or math.isnan(y)) else math.nan

    return {"hit_rate": ratio(a.hit_rate, b.hit_rate), "ttft_p90": ratio(b.ttft_p90, a.ttft_p90),
            "ttft_mean": ratio(b.ttft_mean, a.ttft_mean)}


__all__ = ["fraction_of_ideal", "simulate_ideal"]
