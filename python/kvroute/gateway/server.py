"""Running the gateway: uvicorn with uvloop and httptools, graceful drain on SIGTERM/SIGINT
(uvicorn stops accepting, waits up to shutdown_timeout for requests in flight, then the
ASGI lifespan shutdown closes the pool and the subscribers)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .config import GatewayConfig, from_args


def uvicorn_config(app: Any, config: GatewayConfig) -> Any:
    """The uvicorn.Config the gateway runs under."""
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - Windows
        loop = "asyncio"
    return uvicorn.Config(app, host=config.host, port=config.port, loop=loop, http="httptools",
                          lifespan="on", access_log=False, log_level=config.log_level,
                          server_header=False, date_header=False, proxy_headers=False,
                          timeout_graceful_shutdown=max(1, round(config.shutdown_timeout)), backlog=4096)


def serve(config: GatewayConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    import uvicorn

    from .app import Gateway

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = Gateway(config)
    print(f"kvroute serve: http://{config.host}:{config.port}  policy={config.policy} "
          f"mode={app.router.config.mode} replicas={', '.join(app.fleet.replicas)}", flush=True)
    uvicorn.Server(uvicorn_config(app, config)).run()


def main(args: argparse.Namespace) -> int:
    """`kvroute serve`."""
    config = from_args(args)
    if not config.replicas:
        raise ValueError("give at least one --replica (or replica = [...] in --config)")
    serve(config)
    return 0
