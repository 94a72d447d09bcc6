"""Replaying a workload over an OpenAI-compatible API, streamed, and timing every request.

aiohttp rather than httpx: one client dependency shared with the gateway (contract C5),
and its connection pool and line reader keep a single client process ahead of the
servers it measures (httpx's async client costs several times more CPU per streamed
chunk).

Arrivals:
- default: the workload's own timing, scaled by time_scale: each client starts at
  start x time_scale and sends its next turn think_time x time_scale after the previous
  answer ended (closed loop per client, as kvroute simulate runs it);
- rate: open-loop Poisson arrivals at `rate` requests per second, in workload order;
- concurrency: that many requests in flight at all times, in workload order.
Every request asks for the turn's output length (max_tokens, ignore_eos) with
stream_options.include_usage, and sends the turn's session as an X-Session-ID header.
With the workload's own timing, chat turns carry their conversation: the earlier
messages, the answers the server actually gave, and the new user message (conversation());
with rate or concurrency, turns are independent requests (each prompt one user message).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..sim.workloads import Turn, Workload
from .prompts import chat_messages, token_prompt

APIS = ("completions", "chat")


@dataclass
class RequestResult:
    """One request as the client saw it (seconds of wall time, from the run's start)."""

    client: int
    turn: int
    start: float
    ttft: float = math.nan
    e2e: float = math.nan
    tpot: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str | None = None
    #: Which server got it: 0 for BenchConfig.url, i for spread[i - 1].
    target: int = 0


@dataclass(frozen=True)
class BenchConfig:
    """How to drive the server (see the module docstring)."""

    url: str
    api: str = "completions"
    model: str | None = None
    rate: float | None = None
    concurrency: int | None = None
    requests: int | None = None
    duration: float | None = None
    time_scale: float = 1.0
    seed: int = 0
    timeout: float = 600.0
    #: Further base URLs: requests go round-robin over (url, *spread), one after the other
    #: (several gateways in front of one fleet).
    spread: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give at most one of rate and concurrency")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a finite number > 0, got {self.rate!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale!r}")


def _body(cfg: BenchConfig, turn: Turn, block_tokens: int, key: int,
          messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": int(turn.output_tokens), "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.api == "chat":
        body["messages"] = messages if messages is not None else chat_messages(turn, block_tokens, key)
    else:
        body["prompt"] = token_prompt(turn, block_tokens, key)
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    text = ""
    for choice in obj.get("choices") or ():
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


async def _read_stream(resp: Any, res: RequestResult, t_send: float, t0: float) -> str:
    """Fill `res` from an SSE stream; returns the streamed text."""
    chunks = 0
    pieces: list[str] = []
    use: dict[str, Any] | None = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            raise _ServerError("stream error")
        text = _chunk_text(obj)
        if text:
            if chunks == 0:
                res.ttft = time.perf_counter() - t_send
            chunks += 1
            pieces.append(text)
        if obj.get("usage"):
            use = obj["usage"]
    res.e2e = time.perf_counter() - t_send
    if use is None:
        res.completion_tokens = chunks
        res.error = "no usage"
    else:
        res.prompt_tokens = int(use.get("prompt_tokens") or 0)
        res.completion_tokens = int(use.get("completion_tokens") or chunks)
        details = use.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
    if chunks == 0 and res.error is None:
        res.error = "empty stream"
    if res.completion_tokens > 1 and not math.isnan(res.ttft):
        res.tpot = (res.e2e - res.ttft) / (res.completion_tokens - 1)
    return "".join(pieces)


class _ServerError(Exception):
    pass


async def _one(session: Any, cfg: BenchConfig, path: str, turn: Turn, wl: Workload, c: int, k: int,
               t0: float, messages: list[dict[str, str]] | None = None) -> tuple[RequestResult, str | None]:
    """One streamed request; returns its result and the answer's text (None on error)."""
    import aiohttp

    res = RequestResult(c, k, time.perf_counter() - t0)
    body = _body(cfg, turn, wl.block_tokens, (c << 20) ^ k, messages)
    headers = {"X-Session-ID": turn.session} if turn.session else {}
    t_send = time.perf_counter()
    try:
        async with session.post(path, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                res.error = f"http {resp.status}"
                return res, None
            answer = await _read_stream(resp, res, t_send, t0)
            return res, (answer if res.error is None else None)
    except asyncio.TimeoutError:
        res.error = "timeout"
    except aiohttp.ClientConnectionError:
        res.error = "connection"
    except (aiohttp.ClientError, ValueError, _ServerError):
        res.error = "bad stream"
    return res, None


def conversation(turn: Turn, previous: tuple[Turn, list[dict[str, str]], str] | None, block_tokens: int,
                 key: int) -> list[dict[str, str]]:
    """The chat messages of `turn`: its whole prompt as one user message for a conversation's
    first turn; later, the previous turn's messages, the answer the server gave, and the
    prompt's text after the previous prompt and answer as the new user message (so the
    server sees its own answer again, as in a real chat)."""
    if previous is None or turn.first:
        return chat_messages(turn, block_tokens, key)
    prev_turn, prev_messages, answer = previous
    text = chat_messages(turn, block_tokens, key)[0]["content"]
    start = min(len(text), prev_turn.prompt_tokens + prev_turn.output_tokens)
    return [*prev_messages, {"role": "assistant", "content": answer}, {"role": "user", "content": text[start:]}]


async def run(cfg: BenchConfig, wl: Workload,
              progress: Callable[[int, int], None] | None = None) -> tuple[list[RequestResult], float]:
    """Replay `wl` against cfg.url; returns the per-request results and the wall seconds."""
    import aiohttp

    order = [(c, k) for c, client in enumerate(wl.clients) for k in range(len(client.turns))]
    total = min(len(order), cfg.requests) if cfg.requests else len(order)
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    results: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    bases = [u.rstrip("/") for u in (cfg.url, *cfg.spread)]
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if cfg.model is None:
            cfg = _with_model(cfg, await _served_model(session, bases[0]))
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration if cfg.duration else math.inf
        state = {"started": 0, "sent": 0}

        def may_start() -> bool:
            if state["started"] >= total or time.perf_counter() >= deadline:
                return False
            state["started"] += 1
            return True

        async def send(c: int, k: int, messages: list[dict[str, str]] | None = None) -> str | None:
            target = state["sent"] % len(bases)
            state["sent"] += 1
            res, answer = await _one(session, cfg, bases[target] + path, wl.clients[c].turns[k], wl, c, k, t0,
                                     messages)
            res.target = target
            results.append(res)
            if progress is not None:
                progress(len(results), total)
            return answer

        if cfg.rate is not None:
            await _open_loop(cfg, order, send, may_start, t0)
        elif cfg.concurrency is not None:
            await _closed_loop(cfg.concurrency, order, send, may_start)
        else:
            await _workload_timing(cfg, wl, send, may_start, t0)
        elapsed = time.perf_counter() - t0
    results.sort(key=lambda r: r.start)
    return results, elapsed


def _with_model(cfg: BenchConfig, model: str | None) -> BenchConfig:
    from dataclasses import replace

    return replace(cfg, model=model)


async def _served_model(session: Any, base: str) -> str | None:
    """The first model /v1/models lists (None when the server does not say)."""
    try:
        async with session.get(base + "/v1/models") as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001 - any failure only means "send no model"
        return None
    return None


async def _open_loop(cfg: BenchConfig, order: list[tuple[int, int]], send: Any, may_start: Any,
                     t0: float) -> None:
    assert cfg.rate is not None
    gaps = np.random.default_rng([cfg.seed, 7]).exponential(1.0 / cfg.rate, len(order))
    at = t0
    tasks = []
    for (c, k), gap in zip(order, gaps):
        at += float(gap)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if not may_start():
            break
        tasks.append(asyncio.ensure_future(send(c, k)))
    await asyncio.gather(*tasks)


async def _closed_loop(concurrency: int, order: list[tuple[int, int]], send: Any, may_start: Any) -> None:
    it = iter(order)

    async def worker() -> None:
        for c, k in it:
            if not may_start():
                return
            await send(c, k)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _workload_timing(cfg: BenchConfig, wl: Workload, send: Any, may_start: Any, t0: float) -> None:
    scale = cfg.time_scale
    bt = wl.block_tokens

    async def client(c: int) -> None:
        cl = wl.clients[c]
        delay = t0 + cl.start * scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        previous: tuple[Turn, list[dict[str, str]], str] | None = None
        for k, turn in enumerate(cl.turns):
            if k and turn.think_time > 0:
                await asyncio.sleep(turn.think_time * scale)
            if not may_start():
                return
            # Chat turns carry the conversation, the server's own answers included.
            messages = conversation(turn, previous, bt, (c << 20) ^ k) if cfg.api == "chat" else None
            answer = await send(c, k, messages)
            previous = None if answer is None or messages is None else (turn, messages, answer)

    await asyncio.gather(*(client(c) for c in range(len(wl.clients))))


__all__ = ["APIS", "BenchConfig", "RequestResult", "conversation", "run"]
