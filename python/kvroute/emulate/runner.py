"""Driving the engine model against the wall clock, one asyncio task per engine.

The engine model (kvroute.sim.engine, contract C3) has an explicit clock: `step(now)`
schedules one step starting at `now` and says how long it takes. The runner maps engine
time to the event loop's clock (engine seconds x time_scale = wall seconds, from the
runner's start), calls step(), sleeps until the step's end and only then delivers its
outputs and publishes its KV events, which is when a real engine's tokens and events
become visible. When the engine has nothing to do the task waits for a request.
Consecutive steps are back to back in engine time (the loop's wake-up latency is made up
by sleeping less); a host that falls more than MAX_LAG behind shows as later step
starts, as an overloaded engine would.

Per request a _Stream collects outputs for the HTTP handler; the handler's disconnect
aborts the engine request (abort_request), as vLLM's does.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

log = logging.getLogger("kvroute.emulate")

#: Wall seconds the loop may fall behind a step's end before engine time slips.
MAX_LAG = 0.02

#: vLLM's buckets for vllm:time_to_first_token_seconds (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _Stream:
    """What the HTTP handler of one request reads: outputs as they become visible."""

    __slots__ = ("outputs", "event", "finished", "aborted", "error", "arrival", "prompt_tokens", "cached_tokens")

    def __init__(self, arrival: float, prompt_tokens: int) -> None:
        self.outputs: list[Any] = []
        self.event = asyncio.Event()
        self.finished = False
        self.aborted = False
        self.error: str | None = None
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: int | None = None

    async def next(self) -> list[Any]:
        """The outputs delivered since the last call (waits for at least one, or an abort)."""
        while not self.outputs and not self.aborted:
            self.event.clear()
            await self.event.wait()
        out, self.outputs = self.outputs, []
        return out


@dataclass
class Histogram:
    """A cumulative histogram with fixed buckets (Prometheus semantics)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.n += 1
        self.total += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                break

    def cumulative(self) -> list[int]:
        """Counts at or below each bucket bound."""
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out


@dataclass
class Counters:
    """What /metrics reports besides the engine's own stats."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))


class EngineRunner:
    """One engine model run in real time. publish(events) receives each step's KV events
    when the step ends (None: dropped). time_scale: wall seconds per engine second."""

    def __init__(self, engine_factory: Callable[[Callable[[list[Any]], None]], Any], *,
                 time_scale: float = 1.0, publish: Callable[[list[Any]], Any] | None = None) -> None:
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
        self._pending_events: list[Any] = []
        self.engine = engine_factory(self._pending_events.extend)
        self.time_scale = float(time_scale)
        self.publish = publish
        self.counters = Counters()
        self.streams: dict[str, _Stream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed: str | None = None

    # -- clock -------------------------------------------------------------------------
    def now(self) -> float:
        """Engine time: wall seconds since start / time_scale."""
        assert self._loop is not None, "the runner is not started"
        return (self._loop.time() - self._t0) / self.time_scale

    def start(self) -> None:
        """Start the engine task on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        """Cancel the engine task."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # -- requests ----------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], max_tokens: int, output: Any = None) -> _Stream:
        """Add a request to the engine now; its outputs arrive on the returned stream.
        output: the token ids it generates (None: the engine model's default).
        ValueError (from the engine) when it can never fit in the KV memory; RuntimeError
        once the engine model has failed."""
        from ..sim.engine import EngineRequest

        if self.failed is not None:
            raise RuntimeError(f"the engine model failed: {self.failed}")
        now = self.now()
        req = EngineRequest(request_id=request_id, prompt=np.asarray(prompt, dtype=np.int64),
                            max_tokens=int(max_tokens), arrival=now, output=output)
        self.engine.add_request(req, now)  # ValueError: can never fit in the KV memory
        stream = _Stream(now, len(prompt))
        self.streams[request_id] = stream
        self.counters.prompt_tokens += len(prompt)
        assert self._wake is not None
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone): the engine frees it, its stream ends."""
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        try:
            self.engine.abort_request(request_id, self.now())
        except KeyError:
            pass  # it finished in the step now running; its outputs are simply not delivered
        stream.aborted = True
        stream.event.set()
        self.counters.aborted += 1

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._steps()
        except Exception as exc:
            # A bug in the engine model: every waiting client gets an error instead of
            # hanging, and later requests are refused with the same message.
            log.exception("the engine model failed; this engine refuses requests from now on")
            self.failed = f"{type(exc).__name__}: {exc}"
            for stream in self.streams.values():
                stream.error = self.failed
                stream.aborted = True
                stream.event.set()
            self.streams.clear()

    async def _steps(self) -> None:
        assert self._wake is not None and self._loop is not None
        loop = self._loop
        last_end = -math.inf
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.now()
            # Back-to-back steps start where the previous one ended, so the loop's wake-up
            # latency does not stretch engine time; a host lagging by more than MAX_LAG
            # wall seconds lets engine time slip instead (the engine is then "slow").
            start = last_end if 0.0 <= now - last_end <= MAX_LAG / self.time_scale else now
            res = self.engine.step(start)
            last_end = res.start + res.duration
            delay = self._t0 + last_end * self.time_scale - loop.time()
            # Yield even for a zero-length step so that HTTP handlers run between steps.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(res.outputs, last_end)

    def _deliver(self, outputs: list[Any], end: float) -> None:
        if self._pending_events:
            events = self._pending_events[:]
            self._pending_events.clear()
            if self.publish is not None:
                self.publish(events)
        c = self.counters
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # aborted while its step ran
            if out.is_first_token:
                stream.cached_tokens = int(out.cached_tokens)
                c.ttft.observe(end - stream.arrival)
            c.generation_tokens += int(out.num_new_tokens)
            if out.finished:
                stream.finished = True
                del self.streams[out.request_id]
                reason = out.finish_reason or "length"
                c.success[reason] = c.success.get(reason, 0) + 1
                c.e2e.observe(end - stream.arrival)
            stream.outputs.append(out)
            stream.event.set()


__all__ = ["Counters", "EngineRunner", "Histogram", "TTFT_BUCKETS"]
