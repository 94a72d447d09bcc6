"""The HTTP front of one emulated engine: a raw ASGI app with vLLM's routes.

POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models,
POST /tokenize, GET /health, GET /metrics. Request and response shapes: protocol.py. A raw
ASGI app rather than Starlette keeps the per-token path to one msgspec encode and one
send. Every error is an OpenAI error object (never a traceback); a client that goes away
aborts its engine request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from . import metrics as _metrics
from . import protocol as P
from .filler import Filler
from .runner import EngineRunner

log = logging.getLogger("kvroute.emulate")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
MAX_BODY = 64 << 20  # bytes; a larger request body is refused (413) before it is buffered


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise P.ApiError(f"the request body exceeds {MAX_BODY} bytes", None, 413, "RequestTooLarge")
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


class EmulatorApp:
    """ASGI app of one engine. tokenizer: a kvroute.tokenize Tokenizer."""

    def __init__(self, runner: EngineRunner, *, model: str, tokenizer: Any, max_model_len: int,
                 engine_index: int = 0) -> None:
        self.runner = runner
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.engine_index = engine_index
        self.filler = Filler(tokenizer)
        self.created = int(time.time())
        self._routes: dict[tuple[str, str], Callable[..., Awaitable[None]]] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/tokenize"): self._tokenize,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
        }
        self._paths = {p for _, p in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self._routes.get((scope["method"], path))
        if handler is None:
            status = 405 if path in self._paths else 404
            return await _respond(send, status, P.json_encode(
                {"detail": "Method Not Allowed" if status == 405 else "Not Found"}))
        started = False

        async def tracked(msg: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(msg)

        try:
            await handler(scope, receive, tracked)
        except P.ApiError as exc:
            if not started:
                await _respond(send, exc.status, exc.body())
        except ConnectionResetError:
            pass
        except Exception as exc:
            # A bug, not the request's fault: logged with its traceback, answered without it.
            log.exception("%s %s failed", scope["method"], path)
            if not started:
                err = P.ApiError(f"internal error: {type(exc).__name__}", None, 500, "InternalServerError")
                await _respond(send, 500, err.body())

    # -- simple routes -----------------------------------------------------------------
    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"", [])

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = _metrics.render(self.runner, self.model, self.engine_index)
        await _respond(send, 200, body, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.max_model_len}
        await _respond(send, 200, P.json_encode({"object": "list", "data": [card]}))

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's /tokenize: {"prompt"} or {"messages"} -> count, max_model_len, tokens."""
        obj = P.parse_json(await _read_body(receive))
        P.check_model(obj, self.model)
        if "messages" in obj:
            messages = P.check_messages(obj)
            add_gen = obj.get("add_generation_prompt", True)
            if not isinstance(add_gen, bool):
                raise P.ApiError("add_generation_prompt must be a boolean", "add_generation_prompt")
            ids = P.encode_chat(self.tokenizer, messages, add_gen, obj.get("tools"))
        else:
            prompt = obj.get("prompt")
            if not isinstance(prompt, str):
                raise P.ApiError("prompt must be a string (or give messages)", "prompt")
            add_special = obj.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise P.ApiError("add_special_tokens must be a boolean", "add_special_tokens")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special)
        await _respond(send, 200, P.json_encode({"count": len(ids), "max_model_len": self.max_model_len,
                                                 "tokens": ids, "token_strs": None}))

    # -- generation --------------------------------------------------------------------
    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        obj = P.parse_json(await _read_body(receive))
        req = P.parse_completion(obj, self.model, self.tokenizer, self.max_model_len)
        await self._generate(req, scope, receive, send)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        obj = P.parse_json(await _read_body(receive))
        req = P.parse_chat(obj, self.model, self.tokenizer, self.max_model_len)
        await self._generate(req, scope, receive, send)

    async def _generate(self, req: P.GenRequest, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id" and value:
                req.request_id = value.decode("latin-1")
        if req.request_id in self.runner.streams:
            raise P.ApiError(f"request id {req.request_id!r} is already running", "X-Request-Id")
        runner = self.runner
        try:
            stream = runner.submit(req.request_id, req.prompt_ids, req.max_tokens,
                                   self.filler.output(req.max_tokens))
        except RuntimeError as exc:
            raise P.ApiError(str(exc), None, 500, "InternalServerError") from None
        except ValueError as exc:
            raise P.ApiError(f"max_tokens: {exc}", "max_tokens") from None
        # After the body, receive() returns only when the client goes (or the response ends).
        watch = asyncio.ensure_future(receive())
        watch.add_done_callback(lambda _: runner.abort(req.request_id))
        try:
            if req.stream:
                await self._stream(req, stream, send)
            else:
                await self._complete(req, stream, send)
        finally:
            if not watch.done():
                watch.cancel()

    def _finish_reason(self, req: P.GenRequest, out: Any) -> str:
        reason = out.finish_reason or "length"
        # The filler has no EOS: without max_tokens the emulated answer "ends" on its own.
        return "stop" if reason == "length" and not req.explicit_max else reason

    async def _complete(self, req: P.GenRequest, stream: Any, send: Send) -> None:
        n = 0
        finish = "length"
        while True:
            outs = await stream.next()
            if stream.error is not None:
                raise P.ApiError(stream.error, None, 500, "InternalServerError")
            if stream.aborted and not outs:
                return
            for out in outs:
                n += int(out.num_new_tokens)
                if out.finished:
                    finish = self._finish_reason(req, out)
            if stream.finished and not stream.outputs:
                break
        body = P.full_response(req, self.filler.text(0, n), finish, stream.prompt_tokens, n, stream.cached_tokens)
        await _respond(send, 200, body)

    async def _stream(self, req: P.GenRequest, stream: Any, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        n = 0
        first = True
        while True:
            outs = await stream.next()
            if stream.error is not None:
                err = P.ApiError(stream.error, None, 500, "InternalServerError")
                await send({"type": "http.response.body", "body": b"data: " + err.body() + b"\n\n" + P.DONE})
                return
            if stream.aborted and not outs:
                return
            parts: list[bytes] = []
            for out in outs:
                k = int(out.num_new_tokens)
                if first and req.chat:
                    parts.append(P.chunk(req, "", None, role=True))
                first = False
                finish = self._finish_reason(req, out) if out.finished else None
                if k or finish:
                    use = P.usage(stream.prompt_tokens, n + k, None) if req.continuous_usage else None
                    parts.append(P.chunk(req, self.filler.text(n, k), finish, usage_now=use))
                n += k
            if stream.finished and not stream.outputs:
                break
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        if req.include_usage:
            parts.append(P.usage_chunk(req, P.usage(stream.prompt_tokens, n, stream.cached_tokens)))
        parts.append(P.DONE)
        await send({"type": "http.response.body", "body": b"".join(parts)})


__all__ = ["EmulatorApp", "MAX_BODY"]
