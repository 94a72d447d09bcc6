"""A tiny OpenAI-shaped engine for the gateway's tests: a raw ASGI app on uvicorn.

Behaviour is set per process by flags: --ttft (seconds before the first chunk), --chunks
and --gap (stream shape), --fail-status (answer every generation with that status). It
counts what it served in GET /stats (requests, aborted by a client disconnect, in flight,
the session header and prompts it saw). Run: python tests/fake_engine.py --port P --name N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

CACHED = 5
"""cached_tokens every usage block reports."""


class FakeEngine:
    """ASGI app; `stats` is what GET /stats returns."""

    def __init__(self, name: str, ttft: float, chunks: int, gap: float, fail_status: int) -> None:
        self.name, self.ttft, self.chunks, self.gap, self.fail_status = name, ttft, chunks, gap, fail_status
        self.stats = {"name": name, "requests": 0, "aborted": 0, "in_flight": 0, "completed": 0, "sessions": []}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/stats", "/metrics", "/v1/models"):
            return await self._get(path, send)
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            body = b""
            while True:
                msg = await receive()
                body += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            if path == "/tokenize":
                return await self._tokenize(json.loads(body), send)
            return await self._generate(path, json.loads(body), scope, receive, send)
        await _reply(send, 404, {"error": "not found"})

    async def _get(self, path, send):
        if path == "/health":
            return await _reply(send, 200, b"")
        if path == "/stats":
            return await _reply(send, 200, self.stats)
        if path == "/v1/models":
            return await _reply(send, 200, {"object": "list", "data": [
                {"id": "fake-model", "object": "model", "owned_by": self.name, "parent": None},
                {"id": "fake-lora", "object": "model", "owned_by": self.name, "parent": "fake-model"}]})
        text = (f'vllm:num_requests_running{{model_name="fake-model"}} {self.stats["in_flight"]}\n'
                f'vllm:num_requests_waiting{{model_name="fake-model"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} 0.125\n')
        await _reply(send, 200, text.encode(), b"text/plain")

    async def _tokenize(self, obj, send):
        from kvroute.tokenize import load_tokenizer

        tok = load_tokenizer(None)
        if "messages" in obj:
            ids = tok.encode_chat(obj["messages"], add_generation_prompt=obj.get("add_generation_prompt", True))
        else:
            ids = tok.encode(obj["prompt"])
        await _reply(send, 200, {"count": len(ids), "tokens": ids, "max_model_len": 1 << 20})

    async def _generate(self, path, obj, scope, receive, send):
        s = self.stats
        s["requests"] += 1
        for k, v in scope["headers"]:
            if k == b"x-session-id":
                s["sessions"].append(v.decode())
        if self.fail_status:
            return await _reply(send, self.fail_status, {"error": {"message": "injected failure"}})
        s["in_flight"] += 1
        gone = asyncio.ensure_future(receive())  # http.disconnect when the client goes
        try:
            await self._answer(path, obj, send, gone)
        finally:
            s["in_flight"] -= 1
            if not gone.done():
                gone.cancel()

    async def _answer(self, path, obj, send, gone):
        chat = path.endswith("chat/completions")
        usage = {"prompt_tokens": 100, "completion_tokens": self.chunks, "total_tokens": 100 + self.chunks,
                 "prompt_tokens_details": {"cached_tokens": CACHED}}
        if not await self._wait(self.ttft, gone):
            return
        if not obj.get("stream"):
            text = "".join(f"w{i} " for i in range(self.chunks))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                      if chat else {"index": 0, "text": text, "finish_reason": "stop"})
            self.stats["completed"] += 1
            return await _reply(send, 200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                            "created": int(time.time()), "model": obj.get("model"),
                                            "choices": [choice], "usage": usage})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.chunks):
            delta = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps({"id": "x", "choices": [delta]}).encode() + b"\n\n"})
            if i + 1 < self.chunks and not await self._wait(self.gap, gone):
                return
        tail = b""
        if (obj.get("stream_options") or {}).get("include_usage"):
            tail = b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"
        self.stats["completed"] += 1
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

    async def _wait(self, seconds, gone):
        """Sleep unless the client goes first; False (and counted) when it went."""
        if seconds > 0:
            await asyncio.wait([gone], timeout=seconds)
        if gone.done():
            self.stats["aborted"] += 1
            return False
        return True


async def _reply(send, status, obj, ctype=b"application/json"):
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake")
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--gap", type=float, default=0.0)
    p.add_argument("--fail-status", type=int, default=0)
    a = p.parse_args()
    app = FakeEngine(a.name, a.ttft, a.chunks, a.gap, a.fail_status)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="error", loop="uvloop", http="httptools",
                lifespan="off")


if __name__ == "__main__":
    main()
