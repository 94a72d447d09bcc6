"""A model of one vLLM V1 engine: scheduler, paged KV memory with a prefix cache, step time.

One class with an explicit clock (no wall-clock inside): ``Engine.step(now)`` runs one
scheduler step starting at ``now`` and returns what it produced and how long it took, so
the fleet simulator drives it from its event heap and the emulator from a real clock.

Sources followed (vLLM main, read through the project's code search):

- vllm/v1/core/sched/scheduler.py, ``Scheduler.schedule()``: one token budget per step
  (``max_num_batched_tokens``); RUNNING requests first, in order, each getting
  ``num_tokens - num_computed_tokens`` tokens capped by ``long_prefill_token_threshold``
  (when > 0) and by the budget left (chunked prefill); when ``allocate_slots`` fails the
  last running request is preempted (its blocks freed, ``num_computed_tokens = 0``, put
  back at the front of the waiting queue: preemption by recompute) until it fits or the
  request itself was preempted. Then, only if nothing was preempted this step, WAITING
  requests first come first served while the budget lasts and fewer than
  ``max_num_seqs`` run: prefix hit from ``get_computed_blocks``, the rest chunked to the
  budget; a waiting request whose blocks cannot be allocated stays at the head and ends
  admission (it waits; only running requests are preempted). ``update_from_output``: a
  request whose known tokens are all computed samples one token; it finishes at
  ``max_tokens`` and frees its blocks.
- vllm/v1/core/kv_cache_manager.py: ``get_computed_blocks`` (the longest run of cached
  full blocks, at most ``num_tokens - 1`` tokens, because the last token is recomputed
  for its logits), ``allocate_slots`` (blocks for ``computed + new`` tokens; hit blocks
  that sit in the free queue count against the free blocks too; ``None`` when they do
  not fit), ``free`` (a request's blocks in reverse order, so tails are evicted first).
- vllm/v1/core/block_pool.py: ``cache_full_blocks`` (a full block gets its chained hash
  and enters ``cached_block_hash_to_block``; a BlockStored event per call, with parent
  hash and token ids), the free block queue (blocks with ref count 0, evicted from the
  head in LRU order; a freed block keeps its hash and stays a prefix hit until it is
  reused: ``_maybe_evict_cached_block`` then drops the hash and emits BlockRemoved),
  ``touch`` (a hit takes a free cached block out of the queue and pins it), no
  de-duplication of identical blocks (two copies, two BlockStored, two BlockRemoved).

One deliberate difference, a parameter: vLLM registers a block's hash when the block is
allocated for the step that computes it (``allocate_slots`` calls ``cache_blocks`` for
``computed + new`` tokens), so a twin admitted later in the *same* step already hits.
By default (``cache_on_schedule=False``) this model registers blocks when the step that
computes them ends (chunk by chunk), as SGLang's radix cache inserts after each chunk:
duplicates admitted in the same step both miss. ``cache_on_schedule=True`` is vLLM's
exact rule.

Not modelled: the null block vLLM reserves (block 0), speculative decoding, KV
connectors/offload, priorities, async scheduling, encoder inputs, sliding windows.

Step time (``EngineConfig.step_time``), an additive roofline: ``step_fixed_s`` (reading
the weights once per forward pass, plus scheduling and sampling) + ``per_token_s`` per
batched token (the GEMMs, compute bound) + ``per_kv_token_s`` per KV token that decodes
attend to (reading the KV cache, memory bound). Prefill attention is folded into the
per-token cost. Defaults: Llama-3.1-8B-Instruct (8.03 B parameters, 32 layers, 8 KV heads
of 128 dims: 2 x 32 x 8 x 128 x 2 bytes = 128 KiB of BF16 KV per token) on one NVIDIA
A100-SXM4-40GB (312 TFLOPS dense BF16, 1,555 GB/s HBM2; NVIDIA A100 datasheet):

- step_fixed_s = 12 ms: 16.06 GB of BF16 weights / 1,555 GB/s = 10.3 ms, plus ~1.5 ms
  of scheduling, sampling and launch overhead (vLLM reports single-request inter-token
  latencies of 10-15 ms for 8B models on A100).
- per_token_s = 100 us: 2 x 8.03 GFLOP per token at 50% of 312 TFLOPS (16.06e9 /
  1.56e14 = 103 us), i.e. ~10,000 prefill tokens/s, the prefill rate the seed's model
  and RouterConfig.prefill_rate use.
- per_kv_token_s = 0.1 us: 131,072 bytes per token at ~85% of 1,555 GB/s.
- num_kv_blocks: 40 GB x 0.92 utilization - 16.06 GB weights - ~2 GB activations leaves
  ~20 GiB, 163,840 tokens = 10,240 blocks of 16 (the simulator's chat cache).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True)
class EngineConfig:
    """One engine's scheduler limits, KV memory and step-time model (module docstring).

    block_size: tokens per KV block (16). num_kv_blocks: KV memory in blocks, shared by
    running requests and the prefix cache (10,240). max_num_batched_tokens: the token
    budget of one step (8192, vLLM's default). max_num_seqs: most running requests (256).
    long_prefill_token_threshold: most tokens one request gets per step, 0 = no cap (vLLM's
    default with one partial prefill). enable_prefix_caching (True). cache_on_schedule:
    register blocks when scheduled (vLLM) instead of when computed (False, default).
    hash_salt: salt of the token-id hash chain (kvroute.block_hashes). model, gpu: what
    the cost parameters describe. step_fixed_s, per_token_s, per_kv_token_s: the cost model.
    """

    block_size: int = 16
    num_kv_blocks: int = 10_240
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    cache_on_schedule: bool = False
    hash_salt: str | None = None
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    gpu: str = "NVIDIA A100-SXM4-40GB"
    step_fixed_s: float = 0.012
    per_token_s: float = 1.0e-4
    per_kv_token_s: float = 1.0e-7

    def __post_init__(self) -> None:
        for name, low in (("block_size", 1), ("num_kv_blocks", 1), ("max_num_batched_tokens", 1),
                          ("max_num_seqs", 1), ("long_prefill_token_threshold", 0)):
            _check_int(name, getattr(self, name), low)
        for name in ("enable_prefix_caching", "cache_on_schedule"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("step_fixed_s", "per_token_s", "per_kv_token_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.hash_salt is not None and not isinstance(self.hash_salt, str):
            raise TypeError(f"hash_salt must be a str or None, got {type(self.hash_salt).__name__}")

    def step_time(self, batched_tokens: int, decode_kv_tokens: int = 0) -> float:
        """Seconds of one step that computes batched_tokens and whose decodes read
        decode_kv_tokens KV tokens."""
        return self.step_fixed_s + self.per_token_s * batched_tokens + self.per_kv_token_s * decode_kv_tokens

    @property
    def prefill_rate(self) -> float:
        """Prefill tokens per second once a step is full (1 / per_token_s)."""
        return 1.0 / self.per_token_s if self.per_token_s > 0 else math.inf


@dataclass
class EngineRequest:
    """One request for the engine.

    request_id: unique among the engine's live requests. prompt: token ids (1-D ints), or
    None when block_hashes are given instead (the simulator's workloads: then
    num_prompt_tokens is required and events carry no token ids). max_tokens: tokens to
    generate (>= 1; there is no EOS). arrival: seconds (reported, not used to schedule).
    lora_name, cache_salt, mm: per-request cache keys passed to kvroute.block_hashes.
    output: the token ids the request generates (default: a fixed filler sequence), so
    output blocks hash like a real continuation. block_hashes: chained hashes of the full
    blocks of prompt + output (only these blocks can be cached; fewer is allowed).
    """

    request_id: str
    prompt: Any
    max_tokens: int
    arrival: float = 0.0
    lora_name: str | None = None
    cache_salt: str | None = None
    mm: Sequence[tuple[str, int, int]] | None = None
    output: Any = None
    block_hashes: Any = None
    num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in a step (only requests that sampled a token appear).

    num_new_tokens: tokens sampled (1 per step; k for a run_decodes batch of k steps).
    cached_tokens: the prefix hit at its first admission, as vLLM reports num_cached_tokens.
    finish_reason: "length" when max_tokens was reached, else None.
    """

    request_id: str
    num_new_tokens: int
    is_first_token: bool
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None = None


@dataclass(frozen=True)
class StepResult:
    """One scheduler step: it starts at `start`, its outputs and events are visible at
    start + duration. scheduled: (request_id, tokens) in batch order; preempted: request
    ids preempted while scheduling; steps: model steps it stands for (run_decodes)."""

    start: float
    duration: float
    outputs: list[RequestOutput]
    events: list[KVEvent] = field(default_factory=list)
    scheduled: tuple[tuple[str, int], ...] = ()
    preempted: tuple[str, ...] = ()
    steps: int = 1

    @property
    def end(self) -> float:
        """start + duration."""
        return self.start + self.duration


class _Req:
    __slots__ = ("id", "hashes", "tokens", "prompt_len", "max_tokens", "num_tokens", "computed", "out",
                 "blocks", "n_cached", "cached_tokens", "arrival", "lora", "preemptions", "memo")

    def __init__(self, rid: str, hashes: list[int], tokens: np.ndarray | None, prompt_len: int,
                 max_tokens: int, arrival: float, lora: str | None) -> None:
        self.id = rid
        self.hashes = hashes
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_tokens = prompt_len  # prompt + tokens sampled so far
        self.computed = 0  # tokens whose KV is computed (num_computed_tokens)
        self.out = 0
        self.blocks: list[int] = []
        self.n_cached = 0  # leading blocks registered in the cache
        self.cached_tokens = -1
        self.arrival = arrival
        self.lora = lora
        self.preemptions = 0
        self.memo: tuple[int, int, int, list[int]] | None = None  # last failed admission


class Engine:
    """One vLLM-like engine (module docstring). Not thread-safe; drive it from one thread."""

    def __init__(self, config: EngineConfig | None = None, *,
                 on_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        cfg = config or EngineConfig()
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(cfg).__name__}")
        self.config = cfg
        self._on_events = on_events
        self._bs = cfg.block_size
        n = cfg.num_kv_blocks
        self._ref = [0] * n
        self._hash: list[int | None] = [None] * n
        # Free blocks in eviction order (head first); cached ones keep their hash.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        # hash -> the block a hit uses (its oldest cached copy); further copies in _extra.
        self._cached: dict[int, int] = {}
        self._extra: dict[int, list[int]] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._reqs: dict[str, _Req] = {}
        self._events: list[KVEvent] = []
        # Cache versions: a failed admission is retried only when they or the free blocks moved.
        self._n_stores = 0
        self._n_evictions = 0
        self._counters = {"steps": 0, "preemptions": 0, "prefix_queries": 0, "prefix_hits": 0,
                          "finished": 0, "aborted": 0, "evicted_blocks": 0}

    # -- requests -------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, now: float) -> None:
        """Queue a request (FCFS); ValueError for a duplicate id or one that can never fit."""
        if not isinstance(req, EngineRequest):
            raise TypeError(f"req must be an EngineRequest, got {type(req).__name__}")
        rid = req.request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__}")
        if rid in self._reqs:
            raise ValueError(f"request_id {rid!r} is already in the engine")
        _check_int("max_tokens", req.max_tokens, 1)
        tokens, prompt_len, hashes = self._prepare(req)
        bs = self._bs
        if -(-(prompt_len + req.max_tokens) // bs) > self.config.num_kv_blocks:
            raise ValueError(f"request {rid!r} needs {prompt_len + req.max_tokens} tokens of KV, more than "
                             f"num_kv_blocks * block_size = {self.config.num_kv_blocks * bs}")
        r = _Req(rid, hashes, tokens, prompt_len, int(req.max_tokens), float(req.arrival), req.lora_name)
        self._reqs[rid] = r
        self._waiting.append(r)

    def _prepare(self, req: EngineRequest) -> tuple[np.ndarray | None, int, list[int]]:
        if req.prompt is None:
            if req.block_hashes is None or req.num_prompt_tokens is None:
                raise ValueError("a request without prompt tokens needs block_hashes and num_prompt_tokens")
            _check_int("num_prompt_tokens", req.num_prompt_tokens, 1)
            hs = np.asarray(req.block_hashes)
            if hs.ndim != 1 or (hs.size and hs.dtype.kind not in "iu"):
                raise TypeError("block_hashes must be a 1-D integer array")
            return None, int(req.num_prompt_tokens), hs.astype(np.uint64).tolist()
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise TypeError("prompt must be a 1-D sequence of token ids")
        if prompt.size == 0:
            raise ValueError("prompt must not be empty")
        if req.output is None:
            # A fixed continuation: equal prompts generate equal outputs, as greedy decoding would.
            output = (np.arange(req.max_tokens, dtype=np.int64) % 1000) + 1000
        else:
            output = np.asarray(req.output, dtype=np.int64)
            if output.ndim != 1 or output.size < req.max_tokens:
                raise ValueError(f"output must be a 1-D sequence of at least max_tokens={req.max_tokens} ids")
            output = output[: req.max_tokens]
        tokens = np.concatenate([prompt.astype(np.int64), output])
        if req.block_hashes is not None:
            hashes = np.asarray(req.block_hashes).astype(np.uint64).tolist()
        else:
            hashes = self._hash_tokens(tokens, req)
        return tokens, int(prompt.size), hashes

    def _hash_tokens(self, tokens: np.ndarray, req: EngineRequest) -> list[int]:
        import kvroute

        extra: dict[str, Any] = {}
        for key, value in (("lora", req.lora_name), ("cache_salt", req.cache_salt), ("mm", req.mm)):
            if value:
                extra[key] = value  # the per-request keys of contract C1
        return kvroute.block_hashes(tokens, self._bs, salt=self.config.hash_salt, **extra).tolist()

    def abort_request(self, request_id: str, now: float) -> None:
        """Drop a request (waiting or running); its blocks are freed. KeyError if unknown."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        if r in self._running:
            self._running.remove(r)
            self._free_blocks(r)
        else:
            self._waiting.remove(r)
        self._counters["aborted"] += 1

    def has_work(self) -> bool:
        """Whether a step would schedule anything (a request is waiting or running)."""
        return bool(self._running or self._waiting)

    # -- the step -------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at `now` (see the module docstring)."""
        sched, preempted = self._schedule()
        tokens = 0
        kv = 0
        for r, n in sched:
            tokens += n
            if n == 1 and r.out > 0 and r.computed == r.num_tokens - 1:
                kv += r.num_tokens  # a decode attends to its whole context
        duration = self.config.step_time(tokens, kv) if sched else 0.0
        outputs = self._finish_step(sched, 1)
        self._counters["steps"] += 1 if sched else 0
        return self._result(now, duration, outputs, tuple((r.id, n) for r, n in sched), preempted, 1)

    def _result(self, now: float, duration: float, outputs: list[RequestOutput],
                scheduled: tuple[tuple[str, int], ...], preempted: tuple[str, ...], steps: int) -> StepResult:
        events, self._events = self._events, []
        if events and self._on_events is not None:
            self._on_events(events)
        return StepResult(float(now), duration, outputs, events, scheduled, preempted, steps)

    def _schedule(self) -> tuple[list[tuple[_Req, int]], tuple[str, ...]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        thr = cfg.long_prefill_token_threshold
        running = self._running
        sched: list[tuple[_Req, int]] = []
        preempted: list[str] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.num_tokens - r.computed
            if 0 < thr < n:
                n = thr
            n = min(n, budget)
            fits = self._allocate(r, n, ())
            while not fits:
                victim = running.pop()  # FCFS: the last admitted goes first
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is r:
                    break
                fits = self._allocate(r, n, ())
            if not fits:
                break
            sched.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(sched, budget)
        return sched, tuple(preempted)

    def _admit(self, sched: list[tuple[_Req, int]], budget: int) -> None:
        cfg = self.config
        thr = cfg.long_prefill_token_threshold
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            r = waiting[0]
            memo = r.memo
            if memo is not None and memo[0] == self._n_evictions and memo[1] == self._n_stores \
                    and self._room() <= memo[2]:
                break  # nothing it depends on changed since it last failed: it fails again
            if not cfg.enable_prefix_caching:
                hit = []
            elif memo is not None and memo[0] == self._n_evictions:
                hit = self._computed_blocks(r, memo[3])  # no eviction: its earlier hits still hold
            else:
                hit = self._computed_blocks(r, [])
            computed = len(hit) * self._bs
            n = r.num_tokens - computed
            if 0 < thr < n:
                n = thr
            n = min(n, budget)
            r.computed = computed
            r.n_cached = len(hit)
            if not self._allocate(r, n, hit):
                r.computed = r.n_cached = 0
                r.memo = (self._n_evictions, self._n_stores, self._room(), hit)
                break  # it waits at the head: only running requests are preempted
            r.memo = None
            waiting.popleft()
            c = self._counters
            c["prefix_queries"] += r.num_tokens
            c["prefix_hits"] += computed
            if r.cached_tokens < 0:
                r.cached_tokens = computed
            self._running.append(r)
            sched.append((r, n))
            budget -= n

    def _finish_step(self, sched: list[tuple[_Req, int]], steps: int) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        done = False
        for r, n in sched:
            r.computed += n
            self._cache(r, r.computed)  # cache_on_schedule: already done, except in run_decodes
            if r.computed < r.num_tokens:
                continue  # a prefill chunk: no token yet
            r.out += steps
            r.num_tokens += steps
            fin = r.out >= r.max_tokens
            outputs.append(RequestOutput(r.id, steps, r.out == steps, fin, r.prompt_len, max(r.cached_tokens, 0),
                                         "length" if fin else None))
            if fin:
                done = True
                self._free_blocks(r)
                del self._reqs[r.id]
                self._counters["finished"] += 1
        if done:
            self._running = [r for r in self._running if r.out < r.max_tokens]
        return outputs

    # -- decode batches ---------------------------------------------------------------------

    def decode_only(self) -> bool:
        """Whether the next steps are pure decodes: every running request has exactly one
        token to compute, and nothing waits or the head of the queue cannot be admitted."""
        return self._decode_only() is not None

    def _decode_only(self) -> tuple[int | None] | None:
        """None if not decode-only; else (the hash whose caching could unblock the waiting
        head, or None when nothing waits or no store can unblock it)."""
        run = self._running
        if not run or len(run) > self.config.max_num_batched_tokens:
            return None
        for r in run:
            if r.out == 0 or r.num_tokens - r.computed != 1:
                return None
        if not self._waiting:
            return (None,)
        return self._blocked_head(self.config.max_num_batched_tokens - len(run))

    def _blocked_head(self, budget: int) -> tuple[int | None] | None:
        """(next hash) if the waiting head cannot be admitted now with `budget` tokens left,
        else None. While only decodes run and none finishes, free blocks only shrink and the
        head's need (new blocks + hit blocks taken from the free queue) never drops, unless
        a store extends its hit: the caller must stop before its next hash is stored."""
        cfg = self.config
        if budget <= 0 or len(self._running) >= cfg.max_num_seqs:
            return (None,)
        r = self._waiting[0]
        hit = self._computed_blocks(r, []) if cfg.enable_prefix_caching else []
        computed = len(hit) * self._bs
        n = r.num_tokens - computed
        thr = cfg.long_prefill_token_threshold
        if 0 < thr < n:
            n = thr
        n = min(n, budget)
        need = max(-(-(computed + n) // self._bs) - len(hit), 0)
        if need + self._unpinned(hit) <= self._room():
            return None  # it could be admitted: run a real step
        nxt = len(hit)
        limit = min((r.num_tokens - 1) // self._bs, len(r.hashes))
        return (r.hashes[nxt] if nxt < limit and cfg.enable_prefix_caching else None,)

    def run_decodes(self, now: float, until: float, max_steps: int | None = None) -> StepResult | None:
        """Run k >= 1 consecutive decode-only steps in one call, exactly as k step() calls
        would (same batches, times, blocks and cache), when nothing else can happen in
        between: k stops at the first step in which a request finishes, before memory would
        run out, and before the step that would end after `until` (the caller's next
        external event). A waiting head that cannot be admitted stays waiting (it could only
        get in after a finish, or when a block it needs is stored: then None). None when the
        engine is not decode-only or not even one step fits.

        The result stands for k steps: start = now, duration = the k steps' total, each
        output has num_new_tokens = k, events come at the end.
        """
        state = self._decode_only()
        if state is None:
            return None
        run = self._running
        cfg = self.config
        n = len(run)
        k = min(r.max_tokens - r.out for r in run)
        if max_steps is not None:
            k = min(k, max_steps)
        k = min(k, self._steps_in_memory(k))
        per_step = cfg.step_fixed_s + cfg.per_token_s * n + cfg.per_kv_token_s * sum(r.num_tokens for r in run)
        grow = cfg.per_kv_token_s * n
        k = min(k, _steps_before(until - now, per_step, grow))
        if k < 1:
            return None
        wanted = state[0]
        if wanted is not None:
            bs = self._bs
            for r in run:
                if wanted in r.hashes[r.n_cached: (r.computed + k) // bs]:
                    return None  # this stretch would cache a block the head can hit
        duration = k * per_step + grow * k * (k - 1) / 2.0
        for r in run:
            self._allocate(r, k, ())  # fits: _steps_in_memory checked the total
        sched = [(r, 1) for r in run]
        for r, _ in sched:
            r.computed += k - 1  # _finish_step adds the last one
        outputs = self._finish_step(sched, k)
        self._counters["steps"] += k
        return self._result(now, duration, outputs, tuple((r.id, 1) for r, _ in sched), (), k)

    def _steps_in_memory(self, k: int) -> int:
        """Most steps <= k whose new blocks fit in the free blocks."""
        bs = self._bs
        free = self._room()
        run = self._running

        def need(steps: int) -> int:
            total = 0
            for r in run:
                extra = -(-(r.computed + steps) // bs) - len(r.blocks)
                if extra > 0:
                    total += extra
            return total

        if need(k) <= free:
            return k
        lo, hi = 0, k  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    # -- KV cache (vllm/v1/core/kv_cache_manager.py, block_pool.py) --------------------------

    def _computed_blocks(self, r: _Req, known: list[int]) -> list[int]:
        """Leading cached blocks of r, at most num_tokens - 1 tokens (get_computed_blocks),
        continuing after `known`, a prefix found earlier that is still cached."""
        limit = min((r.num_tokens - 1) // self._bs, len(r.hashes))
        k = len(known)
        if k >= limit:
            return known[:limit]
        found = list(map(self._cached.get, r.hashes[k:limit]))  # C speed; cut at the first miss
        try:
            found = found[: found.index(None)]
        except ValueError:
            pass
        return known + found if known else found  # type: ignore[return-value]

    def _allocate(self, r: _Req, n: int, hit: Sequence[int]) -> bool:
        """Blocks for r.computed + n tokens (hit: cached blocks to pin first); False if they
        do not fit, with nothing changed (allocate_slots)."""
        need = max(-(-(r.computed + n) // self._bs) - len(r.blocks) - len(hit), 0)
        room = self._room()
        if need > room:
            return False
        free = self._free
        ref = self._ref
        if hit:
            # Hit blocks in the free queue leave it: they count against the free blocks.
            if need + self._unpinned(hit) > room:
                return False
            for b in hit:
                if ref[b] == 0:
                    del free[b]
                ref[b] += 1
            r.blocks.extend(hit)
        if need:
            r.blocks.extend(self._pop_free(need))
        if self.config.cache_on_schedule:
            self._cache(r, min(r.computed + n, r.num_tokens))
        return True

    def _room(self) -> int:
        """Blocks this engine may still take: the free blocks (kvroute.sim.ideal's pooled
        engines cap them at their own share)."""
        return len(self._free)

    def _unpinned(self, hit: Sequence[int]) -> int:
        """How many of the hit blocks taking them costs a block of room: those in the free
        queue (no running request holds them)."""
        return list(map(self._ref.__getitem__, hit)).count(0)

    def _victim(self) -> int:
        """The free block to take next: the head of the free queue (LRU); kvroute.sim.ideal's
        pooled engines choose by next use instead."""
        return self._free.popitem(last=False)[0]

    def _pop_free(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue, evicting cached ones
        (_maybe_evict_cached_block); one BlockRemoved event lists the evicted hashes."""
        victim = self._victim
        hashes = self._hash
        cached = self._cached
        ref = self._ref
        out = []
        evicted = []
        for _ in range(count):
            b = victim()
            h = hashes[b]
            if h is not None:
                if h in self._extra:
                    self._drop_copy(h, b)
                else:
                    del cached[h]
                hashes[b] = None
                evicted.append(h)
            ref[b] = 1
            out.append(b)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
            self._counters["evicted_blocks"] += len(evicted)
            self._n_evictions += 1
        return out

    def _drop_copy(self, h: int, b: int) -> None:
        """Forget block b as a copy of h when h has several copies."""
        extra = self._extra[h]
        if self._cached[h] == b:
            self._cached[h] = extra.pop(0)
        else:
            extra.remove(b)
        if not extra:
            del self._extra[h]

    def _cache(self, r: _Req, num_tokens: int) -> None:
        """Register r's full, computed blocks up to num_tokens (cache_full_blocks)."""
        if not self.config.enable_prefix_caching:
            return
        bs = self._bs
        full = min(num_tokens // bs, len(r.hashes), len(r.blocks))
        start = r.n_cached
        if full <= start:
            return
        hs = r.hashes
        cached = self._cached
        for i in range(start, full):
            b = r.blocks[i]
            h = hs[i]
            self._hash[b] = h
            if h in cached:
                self._extra.setdefault(h, []).append(b)  # no de-duplication, as vLLM
            else:
                cached[h] = b
        r.n_cached = full
        self._n_stores += 1
        toks = () if r.tokens is None else tuple(r.tokens[start * bs: full * bs].tolist())
        self._events.append(BlockStored(tuple(hs[start:full]), hs[start - 1] if start else None, toks, bs,
                                        lora_name=r.lora))

    def _free_blocks(self, r: _Req) -> None:
        """Unpin r's blocks, tail first, so tails are evicted before their prefixes."""
        ref = self._ref
        free = self._free
        for b in reversed(r.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        r.blocks = []
        r.n_cached = 0

    def _preempt(self, r: _Req) -> None:
        self._free_blocks(r)
        r.computed = 0
        r.preemptions += 1
        self._counters["preemptions"] += 1
        self._waiting.appendleft(r)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (AllBlocksCleared), only when no block is in use, as
        vLLM's reset_prefix_cache; returns whether it did."""
        if len(self._free) != self.config.num_kv_blocks:
            return False
        self._cached.clear()
        self._extra.clear()
        self._hash = [None] * self.config.num_kv_blocks
        self._n_evictions += 1
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Events not yet delivered by a step (e.g. after reset_prefix_cache)."""
        events, self._events = self._events, []
        return events

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """num_running, num_waiting, kv_usage (used blocks / all, vLLM's usage: cached free
        blocks count as free), prefix_queries and prefix_hits (tokens, at admission),
        waiting_tokens (prompt tokens not yet computed of waiting requests), counters."""
        n = self.config.num_kv_blocks
        out: dict[str, Any] = {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "kv_usage": (n - len(self._free)) / n,
            "num_free_blocks": len(self._free),
            "num_cached_blocks": len(self._cached) + sum(len(v) for v in self._extra.values()),
            "waiting_tokens": sum(r.num_tokens - r.computed for r in self._waiting),
        }
        out.update(self._counters)
        return out

    def load(self) -> tuple[int, int, float]:
        """(num_waiting, num_running, kv_usage): what vLLM's /metrics reports, cheaply."""
        n = self.config.num_kv_blocks
        return len(self._waiting), len(self._running), (n - len(self._free)) / n

    def cached_hashes(self) -> dict[int, int]:
        """hash -> number of cached copies (what replaying the events must give)."""
        return {h: 1 + len(self._extra.get(h, ())) for h in self._cached}

    def block_state(self) -> dict[str, Any]:
        """Internals for invariant checks: ref counts, free ids in order, per-request blocks."""
        return {"ref": list(self._ref), "free": list(self._free),
                "requests": {r.id: list(r.blocks) for r in self._running},
                "hash": list(self._hash)}

    def request_ids(self) -> tuple[list[str], list[str]]:
        """(running ids in order, waiting ids in order)."""
        return [r.id for r in self._running], [r.id for r in self._waiting]

    def progress(self, request_id: str) -> tuple[int, int, int]:
        """(num_computed_tokens, num_tokens, tokens generated) of a live request."""
        r = self._reqs[request_id]
        return r.computed, r.num_tokens, r.out


def _steps_before(budget: float, per_step: float, grow: float) -> int:
    """Largest k >= 0 with k * per_step + grow * k * (k - 1) / 2 <= budget."""
    if budget < per_step or per_step <= 0 or math.isinf(budget):
        return 0 if budget < per_step else 1 << 30
    if grow <= 0:
        return int(budget // per_step)
    # grow/2 k^2 + (per_step - grow/2) k - budget <= 0
    a, b = grow / 2.0, per_step - grow / 2.0
    k = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
    while k > 0 and k * per_step + grow * k * (k - 1) / 2.0 > budget:
        k -= 1
    while (k + 1) * per_step + grow * (k + 1) * k / 2.0 <= budget:
        k += 1
    return k


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


__all__ = ["Engine", "EngineConfig", "EngineRequest", "RequestOutput", "StepResult"]
