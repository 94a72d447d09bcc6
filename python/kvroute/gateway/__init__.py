"""`kvroute serve`: an OpenAI-compatible gateway that embeds the router (the `gateway` extra).

    from kvroute.gateway import Gateway, GatewayConfig, ReplicaSpec
    app = Gateway(GatewayConfig(replicas=(ReplicaSpec("http://127.0.0.1:8001"),)))   # an ASGI app

Modules: config (TOML + flags), app (ASGI routes, lifespan, scrape and health loops),
proxy (tokens -> route -> upstream, streaming, retries, lifecycle), prompt (request bodies
to token ids and cache keys), fleet (replicas, breakers, subscribers), breaker, load
(/metrics and /v1/models parsing), metrics (Prometheus), admin (/kvroute/replicas),
state (what several gateways share: local, or Redis with --state), snapshots (--state-dir).
"""

from __future__ import annotations

from typing import Any

from .config import GatewayConfig, ReplicaSpec, parse_argv

__all__ = ["Gateway", "GatewayConfig", "ReplicaSpec", "parse_argv"]


def __getattr__(name: str) -> Any:
    if name == "Gateway":
        from .app import Gateway

        return Gateway
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
