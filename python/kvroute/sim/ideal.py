"""The ideal fleet: the limit every router is measured against, at the same size.

One shared prefix cache holding the fleet's total KV memory, and one central queue from
which any idle replica takes the next request. Built from the fleet model's own parts
(kvroute.sim.fleet, kvroute.sim.engine): the same replicas, each with its own scheduler
(vLLM's: running first, FCFS admission, chunked prefill), token budget, max_num_seqs,
step time and share of the KV memory for its running requests. What differs is what no
router controls:

- One prefix cache. The engines share one pool of replicas x cache_tokens blocks (one
  hash table, one free queue): a block any replica computed is a prefix hit on every
  replica. Each replica's running requests hold at most one replica's memory: the blocks
  it took out of the free queue count against its quota (a hit on a block another
  replica's request is running on costs nothing: the cache is one memory). No replica
  runs more than it could alone, and none preempts for want of another's memory.
- Eviction by next use (Belady's rule, an oracle): the pool gives out first the free
  blocks that no unfinished request looks up, then the one whose next lookup is farthest
  away. A lookup's time is nominal: a client's turn arrives its think time after the
  previous turn's nominal arrival plus an estimate of that turn's service, shifted by
  how late the client's last request was placed. Engines evict LRU, and LRU is no limit:
  one pooled LRU cache of the fleet's memory keeps fewer chat histories than sticky
  routing's separate ones.
- One central queue, fewest uncached prompt tokens first (then arrival), re-keyed as the
  cache changes. When a replica's step ends (or it is idle) it takes the head while it
  runs fewer than max_num_seqs requests, its prompt tokens yet to compute are fewer than
  one step's token budget, and its free quota holds the head's prompt; among several,
  the one with the fewest such tokens, then the fewest decode tokens, then the most free
  quota. A request joins a replica's next step, chosen as late as possible; no request
  waits behind a replica's prefill or memory while another has room. Shortest first, not
  FIFO: under overload FIFO makes every request of a burst wait as long as the burst, and
  the order requests leave a queue, which engines keep FCFS, sets p90 TTFT.

Not a proof, and not a bound on everything: p99 TTFT can be worse than a router's
(shortest first makes the longest prompts wait); where nothing queues a router can come
within a step or two of the ideal's p90 TTFT; a run is a closed loop (a faster fleet
brings the next turns sooner) and next uses are nominal. Blocks a step computes are
visible to every replica from that step's start, up to one step early for the others (the
engine model registers them when it runs the step): optimistic, as a limit may be.
docs/results.md checks every policy against it on every workload; tests/test_sim_ideal.py
on small ones.

`simulate_ideal()` returns a SimResult like kvroute.sim.simulate (router name "ideal";
router_stats: preemptions, evicted blocks, mean wait in the central queue);
`sweep_ideal()` its goodput; `fraction_of_ideal()` expresses a run against it: hit rate /
ideal hit rate, ideal p90 TTFT / p90 TTFT (1.0 = as fast as the ideal).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from typing import Any, Sequence

from .engine import Engine, EngineConfig, EngineRequest, StepResult, _Req
from .fleet import FleetParams, SimResult, _Request, _Run
from .sweep import SweepResult, search
from .workloads import Workload

EVICTIONS = ("next-use", "lru")


class _Shared:
    """What the pooled engines share besides the blocks: cache versions and the oracle."""

    __slots__ = ("stores", "evictions", "oracle", "on_store")

    def __init__(self) -> None:
        self.on_store: Any = None  # called with the hashes each store registers
        self.stores = 0
        self.evictions = 0
        self.oracle: _NextUse | None = None


class _PooledEngine(Engine):
    """An Engine whose KV block pool (blocks, hashes, free queue, cache) is shared with
    the other engines built on the same `pool` engine, its running requests limited to
    `quota` distinct blocks."""

    _shared: _Shared

    def __init__(self, config: EngineConfig, quota: int, pool: _PooledEngine | None = None) -> None:
        self._shared = pool._shared if pool is not None else _Shared()
        super().__init__(config)
        self._quota = quota
        self._mine: dict[int, int] = {}  # block -> references by this engine's requests
        self._charged: set[int] = set()  # blocks it took out of the free queue, still held
        if pool is not None:
            self._ref, self._hash, self._free = pool._ref, pool._hash, pool._free
            self._cached, self._extra = pool._cached, pool._extra

    # The admission memo compares cache versions: they must count every engine's changes.
    @property  # type: ignore[override]
    def _n_stores(self) -> int:
        return self._shared.stores

    @_n_stores.setter
    def _n_stores(self, value: int) -> None:
        self._shared.stores = value

    @property  # type: ignore[override]
    def _n_evictions(self) -> int:
        return self._shared.evictions

    @_n_evictions.setter
    def _n_evictions(self, value: int) -> None:
        self._shared.evictions = value

    def _room(self) -> int:
        # Its quota less the blocks it took out of the free queue, and never more than the
        # pool has free (a block it shares may be charged to no one once its taker let go).
        return min(self._quota - len(self._charged), len(self._free))

    def _allocate(self, r: _Req, n: int, hit: Sequence[int]) -> bool:
        before = len(r.blocks)
        ref = self._ref
        taken = [b for b in hit if ref[b] == 0]  # hits on blocks in use elsewhere are free
        if not super()._allocate(r, n, hit):
            return False
        mine, charged = self._mine, self._charged
        charged.update(taken)
        charged.update(r.blocks[before + len(hit):])
        for b in r.blocks[before:]:
            mine[b] = mine.get(b, 0) + 1
        return True

    def _free_blocks(self, r: _Req) -> None:
        mine, charged = self._mine, self._charged
        blocks = r.blocks
        for b in blocks:
            left = mine[b] - 1
            if left:
                mine[b] = left
            else:
                del mine[b]
                charged.discard(b)
        super()._free_blocks(r)
        oracle = self._shared.oracle
        if oracle is not None:
            if r.out >= r.max_tokens:  # finished: its lookups are done
                oracle.finished(r.id, r.hashes[: min((r.prompt_len - 1) // self._bs, len(r.hashes))])
            ref, hashes = self._ref, self._hash
            freed = [b for b in blocks if ref[b] == 0]
            oracle.push(freed, [hashes[b] for b in freed])

    def _cache(self, r: _Req, num_tokens: int) -> None:
        start = r.n_cached
        super()._cache(r, num_tokens)
        if r.n_cached > start and self._shared.on_store is not None:
            self._shared.on_store(r.hashes[start:r.n_cached])

    def _victim(self) -> int:
        oracle = self._shared.oracle
        return super()._victim() if oracle is None else oracle.pop(self._free)

    def pending_prefill(self) -> int:
        """Prompt tokens not yet computed, of running requests before their first token and
        of waiting requests (as of the end of the step in flight)."""
        return (sum(r.num_tokens - r.computed for r in self._running if r.out == 0)
                + sum(r.num_tokens - r.computed for r in self._waiting))

    def reset_prefix_cache(self) -> bool:
        """Not supported on a shared pool (it would replace the shared hash table)."""
        raise NotImplementedError("the ideal fleet's shared cache is never reset")


class _NextUse:
    """Belady's choice among the pool's free blocks: the one whose hash the workload looks
    up next farthest in the future, first those no unfinished request looks up; ties: the
    later block of its request first (tails before their prefixes). The next use of a
    hash is the earliest nominal arrival of a request that looks it up (_nominal_uses)
    plus its client's lag (how late its last request was placed against its nominal
    arrival). A heap with stale entries skipped (stamp)."""

    def __init__(self, workload: Workload, fleet: FleetParams, kv_blocks: int, num_blocks: int) -> None:
        self.uses, self.users, self.nominal = _nominal_uses(workload, fleet, kv_blocks)
        self.lag = [0.0] * len(workload.clients)
        self.times: dict[str, float] = {}  # engine request id -> its nominal arrival
        self.stamp = [0] * num_blocks
        # Groups of blocks freed together with one next use: (-next use, -last position,
        # stamp, blocks in position order, taken from the end). At first: all, uncached.
        self.heap: list[tuple[float, int, int, list[int]]] = [(-math.inf, 0, 0, list(range(num_blocks)))]
        self.seq = 0

    def placed(self, rid: str, client: int, turn: int, now: float) -> None:
        """Request rid (the client's turn) was placed on a replica at `now`."""
        t = self.nominal[client][turn]
        self.times[rid] = t
        self.lag[client] = now - t

    def push(self, blocks: list[int], hashes: list[int | None]) -> None:
        """These blocks of one request (in position order, with their hashes) entered the
        free queue."""
        uses, users, lag = self.uses, self.users, self.lag
        group: list[int] = []
        key = 0.0
        for pos, (b, h) in enumerate(zip(blocks, hashes)):
            lst = uses.get(h) if h is not None else None
            k = -(lst[0] + lag[users[h][0]]) if lst and h is not None else -math.inf
            if group and k != key:
                self._group(key, pos - 1, group)
                group = []
            key = k
            group.append(b)
        if group:
            self._group(key, len(blocks) - 1, group)

    def _group(self, key: float, last: int, group: list[int]) -> None:
        self.seq += 1
        seq = self.seq
        stamp = self.stamp
        for b in group:
            stamp[b] = seq
        heapq.heappush(self.heap, (key, -last, seq, group))

    def pop(self, free: dict[int, None]) -> int:
        """Take the victim out of `free` and return it."""
        heap, stamp = self.heap, self.stamp
        if len(heap) > 4 * len(free) + 65_536:
            # A group's blocks are live while their stamp is its own and they are free.
            self.heap = heap = [e for e in heap if any(stamp[b] == e[2] and b in free for b in e[3])]
            heapq.heapify(heap)
        while True:
            _, _, seq, group = heap[0]
            while group:
                b = group.pop()
                if stamp[b] == seq and b in free:
                    if not group:
                        heapq.heappop(heap)
                    del free[b]
                    return b
            heapq.heappop(heap)

    def finished(self, rid: str, hashes: list[int]) -> None:
        """Request rid finished: its lookups of `hashes` are no longer future uses."""
        t = self.times.pop(rid)
        uses, users = self.uses, self.users
        for h in hashes:
            lst = uses[h]
            if len(lst) == 1:
                del uses[h], users[h]
                continue
            i = 0 if lst[0] == t else bisect.bisect_left(lst, t)
            del lst[i]
            del users[h][i]


def _nominal_uses(workload: Workload, fleet: FleetParams,
                  kv_blocks: int) -> tuple[dict[int, list[float]], dict[int, list[int]], list[list[float]]]:
    """(hash -> the sorted nominal arrival times of the served requests that look it up,
    hash -> their clients in the same order, client -> its turns' nominal arrival times).
    A request looks up the blocks of its prompt an engine may hit (at most prompt_tokens -
    1 tokens). A client's turn arrives nominally its think time after the previous turn's
    nominal arrival plus an estimate of that turn's service: its prefill at the full rate
    and its decode steps at twice the fixed step cost."""
    bt = workload.block_tokens
    uses: dict[int, list[float]] = {}
    users: dict[int, list[int]] = {}
    unsorted: set[int] = set()
    nominal: list[list[float]] = []
    for c, client in enumerate(workload.clients):
        t = float(client.start)
        times: list[float] = []
        for k, turn in enumerate(client.turns):
            if k:
                t += turn.think_time
            times.append(t)
            if -(-(turn.prompt_tokens + turn.output_tokens) // bt) <= kv_blocks:  # else rejected
                for h in turn.after_hashes[: (turn.prompt_tokens - 1) // bt].tolist():
                    lst = uses.get(h)
                    if lst is None:
                        uses[h] = [t]
                        users[h] = [c]
                    else:
                        if t < lst[-1]:
                            unsorted.add(h)
                        lst.append(t)
                        users[h].append(c)
            t += turn.prompt_tokens * fleet.per_token_s + turn.output_tokens * 2 * fleet.step_fixed_s
        nominal.append(times)
    for h in unsorted:
        pairs = sorted(zip(uses[h], users[h]))
        uses[h] = [u[0] for u in pairs]
        users[h] = [u[1] for u in pairs]
    return uses, users, nominal


class _CentralQueue:
    """Requests waiting for a replica, fewest uncached prompt tokens first (then arrival).
    Keys follow the pool: a store of the first block a request misses re-keys it at once
    (stored()); an eviction, which can only raise a key, is seen when it reaches the head."""

    def __init__(self, cached: dict[int, int], block_tokens: int) -> None:
        self.cached = cached
        self.bt = block_tokens
        self.heap: list[tuple[int, int, int]] = []  # (key, request id, stamp)
        self.items: dict[int, tuple[_Request, list[int], int]] = {}  # id -> (request, lookups, prompt)
        self.stamp: dict[int, tuple[int, int, int | None]] = {}  # id -> (key, stamp, first miss)
        self.wanted: dict[int, list[int]] = {}  # hash -> ids whose first miss it is
        self.seq = 0

    def __len__(self) -> int:
        return len(self.items)

    def push(self, rid: int, req: _Request, lookups: list[int], prompt_tokens: int) -> None:
        """Queue request rid, which looks up `lookups` (its prompt's cacheable hashes)."""
        self.items[rid] = (req, lookups, prompt_tokens)
        self._rekey(rid)

    def _rekey(self, rid: int) -> int:
        _, hs, prompt = self.items[rid]
        cached = self.cached
        n = 0
        for h in hs:
            if h not in cached:
                break
            n += 1
        miss = hs[n] if n < len(hs) else None
        prev = self.stamp.get(rid)
        if miss is not None and (prev is None or prev[2] != miss):  # else it is listed already
            self.wanted.setdefault(miss, []).append(rid)
        key = prompt - n * self.bt
        self.seq += 1
        self.stamp[rid] = (key, self.seq, miss)
        heapq.heappush(self.heap, (key, rid, self.seq))
        return key

    def stored(self, hashes: Sequence[int]) -> None:
        """Blocks with these hashes entered the cache."""
        wanted, stamp = self.wanted, self.stamp
        for h in hashes:
            rids = wanted.pop(h, None)
            for rid in rids or ():
                st = stamp.get(rid)
                if st is not None and st[2] == h:
                    self._rekey(rid)

    def head(self) -> _Request | None:
        """The request to place next (None: none waits)."""
        heap, stamp = self.heap, self.stamp
        while heap:
            key, rid, seq = heap[0]
            st = stamp.get(rid)
            if st is None or st[1] != seq:
                heapq.heappop(heap)
                continue
            heapq.heappop(heap)
            if self._rekey(rid) <= key:  # still the least: its fresh entry is on top
                return self.items[rid][0]
        return None

    def pop(self) -> tuple[int, _Request]:
        """Remove the head (after head())."""
        while True:
            _, rid, seq = heapq.heappop(self.heap)
            st = self.stamp.get(rid)
            if st is not None and st[1] == seq:
                break
        req = self.items.pop(rid)[0]
        del self.stamp[rid]
        return rid, req


class _IdealRun(_Run):
    """The fleet's event loop with pooled engines and a central shortest-first queue."""

    def __init__(self, workload: Workload, fleet: FleetParams, eviction: str) -> None:
        super().__init__(workload, fleet, None, False, lambda c, t, now: 0, None)
        n = fleet.replicas
        one = fleet.engine_config(workload.block_tokens)
        cfg = EngineConfig(**{**one.__dict__, "num_kv_blocks": one.num_kv_blocks * n})
        first = _PooledEngine(cfg, one.num_kv_blocks)
        self.pooled = [first] + [_PooledEngine(cfg, one.num_kv_blocks, first) for _ in range(n - 1)]
        self.engines = list(self.pooled)
        self.oracle = _NextUse(workload, fleet, self.kv_blocks, cfg.num_kv_blocks) if eviction == "next-use" else None
        first._shared.oracle = self.oracle
        self.central = _CentralQueue(first._cached, workload.block_tokens)
        first._shared.on_store = self.central.stored
        self.queued_s = 0.0  # summed over requests: seconds in the central queue
        self.ending = -1  # the replica whose step end is being handled

    def _arrive(self, c_idx: int, t_idx: int, now: float) -> None:
        req = _Request(c_idx, t_idx, now)
        self.requests.append(req)
        turn = self.wl.clients[c_idx].turns[t_idx]
        bt = self.wl.block_tokens
        if -(-(turn.prompt_tokens + turn.output_tokens) // bt) > self.kv_blocks:
            # Longer than one replica's KV memory: rejected as the fleet rejects it, so
            # both serve the same requests.
            self.rejected += 1
            self._complete(req, now)
            return
        self.central.push(len(self.requests) - 1, req, turn.after_hashes[: (turn.prompt_tokens - 1) // bt].tolist(),
                          turn.prompt_tokens)
        # The loop starts the idle replicas once every request of this instant is queued
        # (fleet._Run.loop); -1 stands for the central queue's dispatch, which goes first.
        self.idle.add(-1)

    def _start_step(self, r: int, now: float) -> StepResult | None:
        if r < 0:
            self._dispatch(now)
            return None
        if r == self.ending:
            return None  # _step_end starts it after the central queue had its turn
        eng = self.engines[r]
        # A decode stretch (kvroute.sim.engine.run_decodes) applies its effects at its start;
        # no request is placed on a replica while its step is in flight, so its early freed
        # room is not seen. Not while its engine has a request waiting: a block another
        # replica stores could make that one fit before the stretch ends.
        res = None if eng._waiting else eng.run_decodes(now, self._horizon(now))
        if res is None:
            res = eng.step(now)
        if not res.scheduled and not res.outputs and res.steps == 1:
            # Nothing scheduled (a step that only preempted): it waits for the next step
            # to end anywhere (_step_end), as the pool may have changed by then.
            self.busy[r] = False
            return None
        self.busy[r] = True
        heapq.heappush(self.events, (res.end, self._next(), r, res))
        return res

    def _step_end(self, r: int, res: Any, now: float) -> None:
        self.ending = r
        super()._step_end(r, res, now)  # outputs and completions; its next step waits
        self.ending = -1
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Place the central queue's heads on replicas with no step in flight while one
        has room (_taker), then start every such replica that has work: a request joins
        a replica's next step, decided when that step starts, as late as possible."""
        central = self.central
        while True:
            head = central.head()
            best = -1 if head is None else self._taker(head)
            if best < 0:
                break
            rid, req = central.pop()
            self.queued_s += now - req.arrival
            req.replica = best
            turn = self.wl.clients[req.client].turns[req.turn]
            if self.oracle is not None:
                self.oracle.placed(str(rid), req.client, req.turn, now)
            self.engines[best].add_request(
                EngineRequest(str(rid), None, turn.output_tokens, req.arrival, block_hashes=turn.after_hashes,
                              num_prompt_tokens=turn.prompt_tokens), now)
        for r, eng in enumerate(self.pooled):
            if not self.busy[r] and eng.has_work():
                self._start_step(r, now)

    def _taker(self, req: _Request) -> int:
        """The replica that takes `req` now (module docstring), or -1 when none has room."""
        turn = self.wl.clients[req.client].turns[req.turn]
        bt = self.wl.block_tokens
        blocks = -(-turn.prompt_tokens // bt)
        limit = self.fleet.max_num_seqs
        best, best_key = -1, (self.fleet.max_num_batched_tokens, 0, 0)
        for r, eng in enumerate(self.pooled):
            if self.busy[r]:
                continue
            room = eng._room() - sum(-(-w.num_tokens // bt) for w in eng._waiting)
            if room < blocks or len(eng._running) + len(eng._waiting) >= limit:
                continue
            # Then the one whose next step is shortest: fewest decode tokens and KV to read.
            key = (eng.pending_prefill(), sum(q.num_tokens for q in eng._running), -room)
            if key < best_key:
                best, best_key = r, key
        return best


def simulate_ideal(workload: Workload, fleet: FleetParams | None = None, *, eviction: str = "next-use") -> SimResult:
    """Run `workload` on the ideal fleet of fleet.replicas replicas (module docstring).

    eviction: "next-use" (the ideal's oracle) or "lru" (the engines' own rule, to measure
    what the oracle adds). router_stats: preemptions, evicted_blocks (summed over the
    replicas) and central_wait_mean (seconds a served request waited in the central queue).
    """
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
    fleet = fleet or FleetParams()
    run = _IdealRun(workload, fleet, eviction)
    started, cpu_started = time.perf_counter(), time.process_time()
    run.loop()
    rec, m = run.measure()
    stats = [e.stats() for e in run.engines]
    served = max(m.requests, 1)
    router_stats = {"preemptions": sum(s["preemptions"] for s in stats),
                    "evicted_blocks": sum(s["evicted_blocks"] for s in stats),
                    "central_wait_mean": run.queued_s / served}
    return SimResult("ideal", workload.name, m, rec, router_stats, time.perf_counter() - started,
                     time.process_time() - cpu_started, tuple(stats))


def sweep_ideal(workload: Workload, fleet: FleetParams | None = None, **kwargs: Any) -> SweepResult:
    """The ideal fleet's goodput: kvroute.sim.sweep's search (same keywords: slo, start,
    step, tol, max_ladder, progress) over simulate_ideal; router name "ideal"."""
    return search(lambda wl: simulate_ideal(wl, fleet), "ideal", workload, **kwargs)


def _ratio(x: float | None, y: float | None) -> float:
    if x is None or y is None or math.isnan(x) or math.isnan(y) or y == 0:
        return math.nan
    return x / y


def fraction_of_ideal(result: SimResult, ideal: SimResult) -> dict[str, float]:
    """A run as a fraction of the ideal: hit_rate (its / ideal's), ttft_p90 and
    ttft_mean (ideal's / its: 1.0 = as fast as the ideal); nan when undefined."""
    a, b = result.metrics, ideal.metrics
    return {"hit_rate": _ratio(a.hit_rate, b.hit_rate), "ttft_p90": _ratio(b.ttft_p90, a.ttft_p90),
            "ttft_mean": _ratio(b.ttft_mean, a.ttft_mean)}


def goodput_fraction(result: SweepResult, ideal: SweepResult) -> float:
    """A router's goodput over the ideal's (sweep_ideal, same SLO and search); nan when
    the ideal's is 0."""
    return _ratio(result.goodput, ideal.goodput)


def goodput_text(sweeps: list[SweepResult], ideal: SweepResult) -> str:
    """One line: each router's goodput as a fraction of the ideal's."""
    return "goodput as a fraction of the ideal's: " + ", ".join(
        f"{sw.router} {_pct(goodput_fraction(sw, ideal))}" for sw in sweeps)


def fraction_text(results: list[SimResult], ideal: SimResult) -> str:
    """One line: each router's hit rate and p90 TTFT as fractions of the ideal's."""
    cells = []
    for res in results:
        f = fraction_of_ideal(res, ideal)
        cells.append(f"{res.router} {_pct(f['hit_rate'])} / {_pct(f['ttft_p90'])}")
    return "fraction of the ideal (hit rate / p90 TTFT): " + ", ".join(cells)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


__all__ = ["EVICTIONS", "fraction_of_ideal", "fraction_text", "goodput_fraction", "goodput_text", "simulate_ideal",
           "sweep_ideal"]
