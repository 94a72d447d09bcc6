"""A Ray Serve replica that wraps kvroute.sim.engine's vLLM model, driven in real time.

For tests and benchmarks of KvrouteRequestRouter on a real (local) Ray cluster without a
GPU: each replica holds one `Engine` (paged KV memory with a prefix cache), so prefix hits
are real and depend on where requests were routed. No Ray import here: wrap the class with
`serve.deployment(SimEngineReplica)`.

Request: a dict or a SimRequest (fields as Ray Serve LLM's request objects carry them): `prompt` (str),
`messages` (chat) or `prompt_token_ids`, `max_tokens` (default 8); other fields (e.g. a
session id) are ignored by the replica. Text is tokenized with kvroute's built-in
byte-level tokenizer (chat: its ChatML-like template), the same text the router's
tokenizer-free mode hashes.

Answer: replica (Ray's replica unique_id when run by Serve), prompt_tokens,
cached_tokens (the engine's prefix hit at admission, as vLLM reports it), ttft (seconds
from arrival at the replica to the first token), decode_s (first token to the end), so a
client derives its own TTFT as end-to-end latency minus decode_s.

The engine's step durations (its cost model: ~10k prefill tokens/s, 12 ms per step) are
slept for real, times `time_scale`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..sim.engine import Engine, EngineConfig, EngineRequest
from ..tokenize import load_tokenizer

@dataclass
class SimRequest:
    """A request object with attributes, as Ray Serve LLM's are (Ray's own
    PrefixCacheAffinityRouter reads `messages` / `prompt` as attributes only)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 8
    user: str | None = None

    def get(self, name: str, default: Any = None) -> Any:
        """Mapping-style access, so replicas read dicts and SimRequests alike."""
        value = getattr(self, name, None)
        return default if value is None else value


#: Shortest sleep of the driver loop when a step scheduled nothing (waiting for memory).
IDLE_S = 0.002


def _replica_name() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not under Serve (unit tests): a local name
        return f"local-{id(object())}"


class SimEngineReplica:
    """One simulated engine per replica; `__call__` serves one request (module doc)."""

    def __init__(self, num_kv_blocks: int = 4096, time_scale: float = 1.0, block_size: int = 16) -> None:
        self._engine = Engine(EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks))
        self._scale = float(time_scale)
        self._tok = load_tokenizer(None)
        self._ids = itertools.count()
        self._first: dict[str, asyncio.Future[float]] = {}
        self._done: dict[str, asyncio.Future[tuple[float, int, int]]] = {}
        self._driver: asyncio.Task[None] | None = None
        self.name = _replica_name()

    def tokens(self, request: Mapping[str, Any] | SimRequest) -> np.ndarray:
        """The prompt's token ids (module doc)."""
        ids, messages = request.get("prompt_token_ids"), request.get("messages")
        if ids is not None:
            return np.asarray(ids, dtype=np.int64)
        if messages is not None:
            return np.asarray(self._tok.encode_chat(list(messages)), dtype=np.int64)
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("request needs prompt, messages or prompt_token_ids")
        return np.asarray(self._tok.encode(prompt), dtype=np.int64)

    async def __call__(self, request: Mapping[str, Any] | SimRequest) -> dict[str, Any]:
        """Run one request through the engine; see the module doc for the answer."""
        rid = f"r{next(self._ids)}"
        loop = asyncio.get_running_loop()
        first, done = loop.create_future(), loop.create_future()
        self._first[rid], self._done[rid] = first, done
        t0 = time.monotonic()
        self._engine.add_request(
            EngineRequest(rid, self.tokens(request), int(request.get("max_tokens", 8)), arrival=t0), t0)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        t_first = await first
        t_end, prompt_tokens, cached = await done
        return {"replica": self.name, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                "ttft": t_first - t0, "decode_s": t_end - t_first}

    async def _drive(self) -> None:
        """Step the engine while it has work, sleeping each step's modelled duration."""
        while self._engine.has_work():
            res = self._engine.step(time.monotonic())
            await asyncio.sleep(max(res.duration * self._scale, IDLE_S if not res.outputs else 0.0))
            now = time.monotonic()
            for out in res.outputs:
                if out.is_first_token and out.request_id in self._first:
                    self._first.pop(out.request_id).set_result(now)
                if out.finished and out.request_id in self._done:
                    self._done.pop(out.request_id).set_result((now, out.prompt_tokens, out.cached_tokens))

    def stats(self) -> dict[str, Any]:
        """The engine's stats (prefix_queries / prefix_hits in tokens) and this replica's name."""
        out = dict(self._engine.stats())
        out["replica"] = self.name
        return out

