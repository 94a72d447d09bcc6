"""Small raw-ASGI helpers shared by the gateway's handlers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
MAX_BODY = 64 << 20
"""Largest request body accepted (bytes)."""

_encode = msgspec.json.Encoder().encode


class HTTPError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


async def read_body(receive: Receive) -> bytes:
    """The whole request body (413 beyond MAX_BODY)."""
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(499, "client disconnected")
        chunk = msg.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > MAX_BODY:
                raise HTTPError(413, f"request body larger than {MAX_BODY} bytes")
            chunks.append(chunk)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> None:
    """A complete JSON response."""
    body = obj if isinstance(obj, bytes) else _encode(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def respond_error(send: Send, err: HTTPError) -> None:
    """An HTTPError as JSON."""
    await respond(send, err.status, error_body(err.status, str(err), err.param))


def decode_json(body: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise)."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj
