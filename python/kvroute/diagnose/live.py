"""Diagnostics: the diagnose analysis fed one routed request at a time (for a gateway).

A gateway (`kvroute serve`) calls observe() for each request it routes and, when known,
reports the first token (first_token()); snapshot() returns what /kvroute/diagnostics
serves: the pooled and per-replica miss-ratio curves, the volatile-prefix findings, cold
and warm TTFT, and per replica the time since it joined and its hit rate. Everything is
bounded: each curve tracks at most max_blocks blocks (SHARDS), the volatile table its
max_entries, TTFT samples the last `ttft_samples` per replica and kind, and replicas are
those the gateway names (a removed replica's row is dropped).

Cold start: a request is cold when its replica joined less than `cold_window_s` seconds
before it arrived (the seed's evals: report cold-start TTFT separately from warm).
Thread-safe: one lock around every call (each call is short: SHARDS work is proportional
to the sampled blocks of one prompt).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from . import mrc
from .volatile import VolatilePrefixDetector


class _Replica:
    __slots__ = ("joined", "curve", "requests", "input_tokens", "cached_tokens", "cold", "warm")

    def __init__(self, joined: float, block_size: int, max_blocks: int, samples: int, rate: float) -> None:
        self.joined = joined
        self.curve = mrc.Shards(block_size, rate=rate, max_blocks=max_blocks)
        self.requests = 0
        self.input_tokens = 0
        self.cached_tokens = 0
        self.cold: deque[float] = deque(maxlen=samples)
        self.warm: deque[float] = deque(maxlen=samples)


class Diagnostics:
    """Live diagnosis of a fleet's prefix caching (see the module docstring).

    block_size: the router's block size (tokens per hash). cache_tokens: KV tokens per
    replica (for the hit rate the curves predict at the fleet's size; None: not shown).
    max_blocks: blocks tracked per curve. rate: the curves' initial SHARDS sampling rate
    (0.01: about one block in a hundred costs any work, so observe() stays cheap on a
    gateway's event loop; fixed-size SHARDS lowers it further when needed). cold_window_s:
    seconds after a replica joins during which its requests count as cold starts.
    volatile_every: the volatile-prefix detector reads one request's tokens in this many
    (4; it costs ~140 us per 2,000-token prompt, the curves ~60 us a request), so its
    counts are over that sample. clock: seconds (time.monotonic).
    """

    def __init__(self, block_size: int = 16, *, cache_tokens: int | None = None, max_blocks: int = 16_384,
                 rate: float = 0.01, cold_window_s: float = 300.0, ttft_samples: int = 2048,
                 volatile: bool = True, volatile_every: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if cache_tokens is not None and (isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int)
                                         or cache_tokens < 1):
            raise ValueError(f"cache_tokens must be an int >= 1 or None, got {cache_tokens!r}")
        if not isinstance(cold_window_s, (int, float)) or not cold_window_s >= 0:
            raise ValueError(f"cold_window_s must be a number >= 0, got {cold_window_s!r}")
        self.block_size = block_size
        self.cache_tokens = cache_tokens
        self.max_blocks = int(max_blocks)
        self.cold_window_s = float(cold_window_s)
        self._samples = int(ttft_samples)
        self._clock = clock
        self._lock = threading.Lock()
        self.rate = float(rate)
        self._pooled = mrc.Shards(block_size, rate=self.rate, max_blocks=self.max_blocks)
        self._volatile = VolatilePrefixDetector(block_size) if volatile else None
        if isinstance(volatile_every, bool) or not isinstance(volatile_every, int) or volatile_every < 1:
            raise ValueError(f"volatile_every must be an int >= 1, got {volatile_every!r}")
        self.volatile_every = volatile_every
        self._seen = 0
        self._replicas: dict[str, _Replica] = {}
        self._pending: dict[Any, tuple[str, float, bool]] = {}

    def add_replica(self, name: str, now: float | None = None) -> None:
        """A replica joined (its cold window starts now). Idempotent."""
        with self._lock:
            self._replica(name, self._now(now))

    def remove_replica(self, name: str) -> None:
        """A replica left: its row and curve are dropped."""
        with self._lock:
            self._replicas.pop(name, None)

    def replica_names(self) -> list[str]:
        """The replicas with a row, in the order they joined."""
        with self._lock:
            return list(self._replicas)

    def observe(self, hashes: Any, replica: str, *, prompt_tokens: int, tokens: Any = None,
                cached_tokens: int | None = None, request_id: Any = None, now: float | None = None) -> None:
        """A routed request: its chained block hashes, the replica it went to, its prompt
        length; tokens (its token ids) feed the volatile-prefix detector; cached_tokens is
        what the engine reported it served from cache (usage.prompt_tokens_details), when
        known (pass it here or to first_token(), not both). request_id: pass it again to
        first_token() to record the TTFT."""
        h = np.asarray(hashes, dtype=np.uint64)
        if h.ndim != 1:
            raise ValueError("hashes must be a flat sequence of block hashes")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, (int, np.integer)) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {prompt_tokens!r}")
        if not isinstance(replica, str):
            raise TypeError(f"replica must be a str, got {type(replica).__name__}")
        with self._lock:
            t = self._now(now)
            rep = self._replica(replica, t)
            self._pooled.add(h, int(prompt_tokens))
            rep.curve.add(h, int(prompt_tokens))
            rep.requests += 1
            rep.input_tokens += int(prompt_tokens)
            if cached_tokens is not None:
                rep.cached_tokens += int(cached_tokens)
            self._seen += 1
            if tokens is not None and self._volatile is not None and self._seen % self.volatile_every == 1 % self.volatile_every:
                self._volatile.observe(np.asarray(tokens, dtype=np.int64), h)
            if request_id is not None:
                if len(self._pending) >= 65_536:  # bounded: the oldest unanswered goes
                    self._pending.pop(next(iter(self._pending)))
                self._pending[request_id] = (replica, t, t - rep.joined < self.cold_window_s)

    def first_token(self, request_id: Any, *, cached_tokens: int | None = None, now: float | None = None) -> None:
        """The request's first token arrived: records its TTFT as cold or warm."""
        with self._lock:
            got = self._pending.pop(request_id, None)
            rep = self._replicas.get(got[0]) if got else None
            if got is None or rep is None:
                return
            (rep.cold if got[2] else rep.warm).append(self._now(now) - got[1])
            if cached_tokens is not None:
                rep.cached_tokens += int(cached_tokens)

    def snapshot(self, sizes: Sequence[int] | None = None) -> dict[str, Any]:
        """What /kvroute/diagnostics serves (JSON-ready)."""
        with self._lock:
            now = self._clock()
            per = None if self.cache_tokens is None else max(1, self.cache_tokens // self.block_size)
            n = len(self._replicas)
            top = max(self._pooled.tracked / max(self._pooled.rate, 1e-12), 1.0)
            grid = np.asarray(sizes if sizes is not None else mrc.default_sizes(int(top) + 1, 32), dtype=np.int64)
            pooled = self._pooled.curve(grid)
            out: dict[str, Any] = {"block_size": self.block_size, "pooled": pooled.as_dict(), "replicas": []}
            if per is not None and n:
                out["pooled_at_fleet_cache"] = float(self._pooled.curve([per * n]).hit_rate[0])
                curves = {i: r.curve.curve([per]) for i, r in enumerate(self._replicas.values())}
                out["split_at_fleet_cache"] = float(mrc.fleet_hit_rate(curves, [per])[0])
            cold: list[float] = []
            warm: list[float] = []
            for name, r in self._replicas.items():
                cold += r.cold
                warm += r.warm
                out["replicas"].append({
                    "replica": name, "joined_s_ago": round(now - r.joined, 3), "requests": r.requests,
                    "hit_rate": r.cached_tokens / r.input_tokens if r.input_tokens else None,
                    "predicted_hit_rate": (float(r.curve.curve([per]).hit_rate[0]) if per is not None else None),
                    "ttft_p90_cold": _p90(r.cold), "ttft_p90_warm": _p90(r.warm)})
            out["ttft"] = {"cold": {"samples": len(cold), "p50": _p(cold, 50), "p90": _p(cold, 90)},
                           "warm": {"samples": len(warm), "p50": _p(warm, 50), "p90": _p(warm, 90)}}
            if self._volatile is not None:
                out["volatile"] = {**self._volatile.report().as_dict(), "sampled_every": self.volatile_every}
            return out

    def _replica(self, name: str, t: float) -> _Replica:
        rep = self._replicas.get(name)
        if rep is None:
            rep = self._replicas[name] = _Replica(t, self.block_size, self.max_blocks, self._samples, self.rate)
        return rep

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else float(now)


def _p(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values), q)), 6) if len(values) else None


def _p90(values: Sequence[float]) -> float | None:
    return _p(values, 90)


__all__ = ["Diagnostics"]
