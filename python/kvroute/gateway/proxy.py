"""The request path: tokens -> route -> upstream, the response streamed back byte for byte.

Lifecycle: Router.prefill_done when the first body chunk arrives from the engine (the first
token of a stream; the whole answer otherwise), Router.finish when the response ends, fails,
or the client disconnects (which also closes the upstream connection, so the engine aborts
the request). Faults before any byte reached the client (connect error, timeout, 5xx, a
failed first read) open the replica's breaker and re-route, up to `retries` times; after
the first byte nothing is retried. The engine's answer is held back only until its first
body chunk, so a retry is always possible until then.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from typing import Any

import aiohttp

from .asgi import HTTPError, Receive, Scope, Send, decode_json, read_body, respond, error_body
from .fleet import Fleet, Replica, hash_prompt
from .metrics import GatewayMetrics
from .prompt import BadRequest, Prompt, build_prompt, session_of
from .state import LocalState, SharedState

_HOP = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                  b"trailer", b"upgrade", b"proxy-authorization", b"proxy-authenticate", b"expect"})
_HOP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"})
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
TAIL = 4096
"""Bytes of a response's end kept to read the engine's usage (cached tokens)."""


class UpstreamError(Exception):
    """A failure before any byte reached the client: kind is connect, timeout, status or read."""

    def __init__(self, kind: str, status: int = 502, body: bytes | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(kind)
        self.kind, self.status, self.body, self.headers = kind, status, body, headers


class _Flight:
    """One request's routing state, released exactly once."""

    __slots__ = ("decision", "replica", "prefilled", "done", "score_s")

    def __init__(self, decision: Any, replica: Replica, score_s: float) -> None:
        self.decision, self.replica, self.prefilled, self.done = decision, replica, False, False
        self.score_s = score_s


class Proxy:
    """Handles POST /v1/chat/completions and /v1/completions."""

    def __init__(self, fleet: Fleet, metrics: GatewayMetrics, tokens: Any, *, session_header: str,
                 retries: int, decision_log: Any = None, diagnostics: Any = None) -> None:
        self.fleet = fleet
        self.router = fleet.router
        self.metrics = metrics
        self.tokens = tokens  # LocalTokens or EngineTokens
        self.session_header = session_header.lower().encode("latin-1")
        self.retries = retries
        self.block_size = fleet.router.config.block_size
        self.salt = fleet.config.salt
        self.decision_log = decision_log
        self.diagnostics = diagnostics  # kvroute.diagnose.Diagnostics, fed after each response
        self.http: aiohttp.ClientSession | None = None
        self.state: SharedState = LocalState()  # the Gateway sets the --state backend

    # -- entry ---------------------------------------------------------------------------------

    async def handle(self, kind: str, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Proxy one request; errors before the response started are JSON errors."""
        try:
            body = await read_body(receive)
            obj = decode_json(body)
            prompt, timing = await self._prompt(kind, obj, scope)
        except HTTPError as e:
            if e.status != 499:
                self.metrics.failed.labels(str(e.status)).inc()
                await respond(send, e.status, error_body(e.status, str(e), e.param))
            return
        except BadRequest as e:
            self.metrics.failed.labels("400").inc()
            await respond(send, 400, error_body(400, str(e), e.param))
            return
        task = asyncio.current_task()
        state = {"disconnected": False}
        watcher = asyncio.ensure_future(self._watch(receive, task, state))
        try:
            await self._run(path, body, prompt, timing, scope, send)
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            if sys.version_info >= (3, 11) and task is not None:
                task.uncancel()
            self.metrics.disconnects.inc()
        finally:
            watcher.cancel()

    @staticmethod
    async def _watch(receive: Receive, task: Any, state: dict[str, bool]) -> None:
        # After the body, the next ASGI message is http.disconnect: the client went away
        # (or the response completed and this watcher is cancelled first).
        msg = await receive()
        if msg["type"] == "http.disconnect":
            state["disconnected"] = True
            task.cancel()

    async def _prompt(self, kind: str, obj: dict[str, Any], scope: Scope) -> tuple[Prompt, list[float]]:
        header = None
        for k, v in scope["headers"]:
            if k == self.session_header:
                header = v.decode("latin-1")
                break
        session = session_of(obj, header)
        t0 = time.perf_counter()
        if kind == "chat":
            ids = self.tokens.chat(obj, session)
        else:
            ids = self.tokens.completion(obj)
        if asyncio.iscoroutine(ids):
            ids = await ids
        t1 = time.perf_counter()
        prompt = build_prompt(obj, kind, ids, session, self.fleet.lora_models)
        return prompt, [t1 - t0]

    # -- routing and upstream -----------------------------------------------------------------------

    def _route(self, prompt: Prompt, hashes: Any) -> _Flight:
        t0 = time.perf_counter()
        try:
            d = self.router.route_hashes(hashes, len(prompt.tokens), session=prompt.session)
        except (RuntimeError, ValueError) as e:
            raise HTTPError(503, f"no replica can take the request: {e}") from e
        score_s = time.perf_counter() - t0
        self.metrics.stage["score"].observe(score_s)
        rep = self.fleet.replicas.get(d.replica)
        if rep is None:  # removed between route and here: cannot happen on one loop
            self.router.finish(d.handle)
            raise HTTPError(503, f"replica {d.replica} is gone")
        if rep.record_routes:
            self.router.index.insert(rep.id, hashes)
        self.state.routed(prompt.session, d.replica, hashes)
        rep.in_flight += 1
        rep.metrics.in_flight.inc()
        rep.metrics.request(d.reason)
        return _Flight(d, rep, score_s)

    def _release(self, f: _Flight) -> None:
        if f.done:
            return
        f.done = True
        f.replica.in_flight -= 1
        f.replica.metrics.in_flight.dec()
        try:
            self.router.finish(f.decision.handle)
        except (KeyError, ValueError):
            pass  # released by remove_replica

    async def _open(self, rep: Replica, path: str, body: bytes, headers: list[tuple[str, str]]) -> tuple[Any, bytes]:
        assert self.http is not None
        try:
            resp = await self.http.post(rep.spec.url + path, data=body, headers=headers)
        except asyncio.TimeoutError as e:
            raise UpstreamError("timeout", 504) from e
        except aiohttp.ClientError as e:
            raise UpstreamError("connect") from e
        try:
            if resp.status >= 500:
                data = await resp.read()
                raise UpstreamError("status", resp.status, data, _response_headers(resp))
            first = await resp.content.readany()
        except asyncio.TimeoutError as e:
            resp.close()
            raise UpstreamError("timeout", 504) from e
        except aiohttp.ClientError as e:
            resp.close()
            raise UpstreamError("read") from e
        except UpstreamError:
            resp.release()
            raise
        except BaseException:  # cancelled (the client left) while waiting for the first byte
            resp.close()
            raise
        return resp, first

    async def _run(self, path: str, body: bytes, prompt: Prompt, timing: list[float], scope: Scope,
                   send: Send) -> None:
        t0 = time.perf_counter()
        arrived = time.monotonic()
        hashes = hash_prompt(prompt.tokens, self.block_size, self.salt, prompt.lora, prompt.cache_salt, prompt.mm)
        timing.append(time.perf_counter() - t0)
        self.metrics.stage["tokenize"].observe(timing[0])
        self.metrics.stage["hash"].observe(timing[1])
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _HOP]
        if prompt.session:  # another gateway may have bound it (bounded wait; none while Redis is down)
            await self.state.before_route(prompt.session)
        try:
            flight = self._route(prompt, hashes)
        except HTTPError as e:
            self.metrics.failed.labels(str(e.status)).inc()
            await respond(send, e.status, error_body(e.status, str(e), e.param))
            return
        attempt = 0
        resp = None
        try:
            while True:
                self._log(flight, prompt, timing, attempt)
                try:
                    resp, first = await self._open(flight.replica, path, body, headers)
                    break
                except UpstreamError as e:
                    self._release(flight)
                    self.fleet.failure(flight.replica, e.kind)
                    if attempt >= self.retries:
                        await self._fail(send, e)
                        return
                    attempt += 1
                    flight.replica.metrics.retries.inc()
                    try:
                        flight = self._route(prompt, hashes)
                    except HTTPError as e2:
                        self.metrics.failed.labels(str(e2.status)).inc()
                        await respond(send, e2.status, error_body(e2.status, str(e2), e2.param))
                        return
            first_at = time.monotonic()
            cached = await self._stream(flight, resp, first, send)
            if self.diagnostics is not None:  # after the last byte: off the client's path
                self.diagnostics.observe(hashes, flight.replica.spec.name, prompt_tokens=len(prompt.tokens),
                                         tokens=prompt.tokens, request_id=flight, now=arrived)
                self.diagnostics.first_token(flight, cached_tokens=cached, now=first_at)
        finally:
            if resp is not None:
                resp.close()  # a no-op after a complete read; aborts the engine's request otherwise
            self._release(flight)

    async def _stream(self, f: _Flight, resp: Any, first: bytes, send: Send) -> int | None:
        """Relay the response; returns the engine's reported cached tokens, if any."""
        self.router.prefill_done(f.decision.handle)
        f.prefilled = True
        headers = _response_headers(resp)
        headers.append((b"x-kvroute-replica", f.replica.spec.name.encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        tail = first[-TAIL:]
        chunk = first
        content = resp.content
        try:
            while True:
                if content.at_eof():  # the last chunk (a whole non-streamed answer): one write
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    break
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await content.readany()
                if chunk:
                    tail = (tail + chunk)[-TAIL:]
                elif not content.at_eof():
                    raise aiohttp.ClientPayloadError("upstream body ended early")
        except (asyncio.TimeoutError, aiohttp.ClientError):
            self.fleet.failure(f.replica, "midstream")
            raise
        m = _CACHED.search(tail)
        if m is not None and resp.status < 400:
            rm = f.replica.metrics
            rm.predicted.inc(f.decision.cached_tokens)
            rm.reported.inc(int(m.group(1)))
            rm.reported_requests.inc()
            return int(m.group(1))
        return None

    async def _fail(self, send: Send, e: UpstreamError) -> None:
        self.metrics.failed.labels(str(e.status)).inc()
        if e.body is not None and e.headers is not None:  # the engine's own 5xx, passed through
            await send({"type": "http.response.start", "status": e.status, "headers": e.headers})
            await send({"type": "http.response.body", "body": e.body})
            return
        await respond(send, e.status, error_body(e.status, f"upstream {e.kind} error"))

    def _log(self, f: _Flight, prompt: Prompt, timing: list[float], attempt: int) -> None:
        if self.decision_log is None:
            return
        d = f.decision
        line = {"t": time.time(), "replica": d.replica, "reason": d.reason, "binding": d.binding,
                "prompt_tokens": d.prompt_tokens, "cached_tokens": d.cached_tokens,
                "matched_blocks": d.matched_blocks, "session": prompt.session, "lora": prompt.lora,
                "attempt": attempt, "tokenize_us": round(timing[0] * 1e6, 1), "hash_us": round(timing[1] * 1e6, 1),
                "score_us": round(f.score_s * 1e6, 1)}
        self.decision_log.write(json.dumps(line) + "\n")


def _response_headers(resp: Any) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _HOP_RESPONSE]
