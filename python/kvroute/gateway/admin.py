"""The admin API: GET/POST /kvroute/replicas, DELETE /kvroute/replicas/{name},
POST /kvroute/replicas/{name}/drain (body {"draining": false} resumes)."""

from __future__ import annotations

from typing import Any

from .asgi import HTTPError, Receive, Scope, Send, decode_json, read_body, respond
from .config import ReplicaSpec
from .fleet import Fleet

PREFIX = "/kvroute/replicas"


class Admin:
    """Handlers over a Fleet."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Dispatch one /kvroute/replicas request."""
        method, path = scope["method"], scope["path"]
        rest = path[len(PREFIX):].strip("/")
        if not rest:
            if method == "GET":
                return await self._list(send)
            if method == "POST":
                return await self._add(receive, send)
            raise HTTPError(405, f"{method} not allowed on {PREFIX}")
        if rest.endswith("/drain") and method == "POST":
            return await self._drain(rest[: -len("/drain")], receive, send)
        if method == "DELETE":
            return await self._remove(rest, send)
        raise HTTPError(405 if method in ("GET", "POST", "PUT") else 404, f"{method} {path} is not an admin route")

    async def _list(self, send: Send) -> None:
        cfg = self.fleet.router.config
        reps = [self.fleet.describe(r) for r in self.fleet.replicas.values()]
        await respond(send, 200, {"policy": cfg.policy, "mode": cfg.mode, "block_size": cfg.block_size,
                                  "replicas": reps})

    async def _add(self, receive: Receive, send: Send) -> None:
        obj = decode_json(await read_body(receive))
        allowed = {"url", "name", "events", "replay", "block_size"}
        for key in obj:
            if key not in allowed:
                raise HTTPError(400, f"unknown field {key!r} (known: {', '.join(sorted(allowed))})", key)
        if not isinstance(obj.get("url"), str):
            raise HTTPError(400, "url must be a string", "url")
        try:
            spec = ReplicaSpec(**obj)
        except (TypeError, ValueError) as e:
            raise HTTPError(400, str(e), _field_of(str(e))) from e
        if spec.name in self.fleet.replicas:
            raise HTTPError(409, f"replica '{spec.name}' already exists", "name")
        # On the loop thread, so no request sees the router and the fleet disagree; a
        # subscriber's start only waits for its thread to open its sockets.
        try:
            rep = self.fleet.add(spec)
        except Exception as e:
            raise HTTPError(400, f"cannot add replica: {e}", "events") from e
        await respond(send, 201, self.fleet.describe(rep))

    async def _remove(self, name: str, send: Send) -> None:
        self._known(name)
        self.fleet.remove(name)
        await respond(send, 200, {"removed": name})

    async def _drain(self, name: str, receive: Receive, send: Send) -> None:
        rep = self._known(name)
        body = await read_body(receive)
        draining: Any = True
        if body.strip():
            draining = decode_json(body).get("draining", True)
            if not isinstance(draining, bool):
                raise HTTPError(400, "draining must be a boolean", "draining")
        self.fleet.drain(name, draining)
        await respond(send, 200, self.fleet.describe(rep))

    def _known(self, name: str) -> Any:
        try:
            return self.fleet.get(name)
        except KeyError as e:
            raise HTTPError(404, f"no replica named '{name}'", "name") from e


def _field_of(message: str) -> str | None:
    for key in ("url", "name", "events", "replay", "block_size"):
        if message.startswith(f"replica {key}"):
            return key
    return None
