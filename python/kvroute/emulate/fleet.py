"""A fleet of emulated engines in one process, on one event loop.

Each engine gets an EngineRunner (the engine model against the wall clock), an
EventPublisher (PUB + replay ROUTER) and a uvicorn server (httptools) for its EmulatorApp.
All share one asyncio loop, so N engines cost one core between them: the engine model's
steps are short Python calls and the loop spends most of its time waiting for step ends.
`kvroute emulate` runs a Fleet until Ctrl-C; tests run one in a background thread
(`FleetThread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import uvicorn

from .app import EmulatorApp
from .publisher import EventPublisher
from .runner import EngineRunner


@dataclass(frozen=True)
class EnginePorts:
    """The three ports of one engine: HTTP, KV-event PUB, replay ROUTER."""

    http: int
    events: int
    replay: int

    @staticmethod
    def consecutive(port: int, events_port: int, replicas: int) -> list[EnginePorts]:
        """`kvroute emulate --replicas N`: HTTP port+i, events port+2i, replay port+2i+1."""
        return [EnginePorts(port + i, events_port + 2 * i, events_port + 2 * i + 1) for i in range(replicas)]


@dataclass(frozen=True)
class EmulatorOptions:
    """Everything but the ports. engine: EngineConfig field overrides (kvroute.sim.engine).
    tokenizer: path of a Hugging Face tokenizer folder or tokenizer.json (None: built-in
    byte-level). time_scale: wall seconds per engine second (0.1 runs 10x faster)."""

    host: str = "127.0.0.1"
    model: str = "kvroute-emulated"
    tokenizer: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    time_scale: float = 1.0
    encoding: str = "maps"
    topic: str = ""
    max_model_len: int = 131_072


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the fleet stops every server at once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"HTTP port {host}:{port}: {exc.strerror}") from None
    return sock


class EmulatedEngine:
    """One engine: runner, publisher, app and its uvicorn server."""

    def __init__(self, index: int, ports: EnginePorts, opts: EmulatorOptions, tokenizer: Any) -> None:
        from ..sim.engine import Engine, EngineConfig

        self.index = index
        self.ports = ports
        host = opts.host
        self.url = f"http://{host}:{ports.http}"
        self.events_endpoint = f"tcp://{host}:{ports.events}"
        self.replay_endpoint = f"tcp://{host}:{ports.replay}"
        config = EngineConfig(**opts.engine)
        # Bind the HTTP socket here so that a port in use is an OSError naming it, before
        # anything runs (uvicorn would log and exit the process instead).
        self.socket = _listen(host, ports.http)
        try:
            self.publisher = EventPublisher(self.events_endpoint, self.replay_endpoint, topic=opts.topic,
                                            encoding=opts.encoding)
        except BaseException:
            self.socket.close()
            raise
        self.config = config
        self.runner = EngineRunner(lambda on_events: Engine(config, on_events=on_events),
                                   time_scale=opts.time_scale, publish=self.publisher.publish)
        self.app = EmulatorApp(self.runner, model=opts.model, tokenizer=tokenizer,
                               max_model_len=opts.max_model_len, engine_index=0)
        self.server = _Server(uvicorn.Config(self.app, host=host, port=ports.http, loop="none", http="httptools",
                                             lifespan="off", log_level="warning", access_log=False,
                                             timeout_graceful_shutdown=1))

    def close(self) -> None:
        """Release the sockets of an engine that never started."""
        self.socket.close()
        self.publisher.close()

    def serve_args(self) -> str:
        """This engine as a `kvroute serve --replica` argument."""
        return f"{self.url},events={self.events_endpoint},replay={self.replay_endpoint}"


class Fleet:
    """N emulated engines; start()/stop() on a running loop."""

    def __init__(self, ports: list[EnginePorts], opts: EmulatorOptions | None = None) -> None:
        from ..tokenize import load_tokenizer

        if not ports:
            raise ValueError("a fleet needs at least one engine")
        self.opts = opts or EmulatorOptions()
        tokenizer = load_tokenizer(self.opts.tokenizer)
        self.engines: list[EmulatedEngine] = []
        try:
            for i, p in enumerate(ports):
                self.engines.append(EmulatedEngine(i, p, self.opts, tokenizer))
        except BaseException:
            for e in self.engines:
                e.close()
            raise
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every engine's runner, replay socket and HTTP server; returns when all listen."""
        for e in self.engines:
            e.runner.start()
            e.publisher.start()
            self._tasks.append(asyncio.get_running_loop().create_task(e.server.serve(sockets=[e.socket])))
        while not all(e.server.started for e in self.engines):
            for t in self._tasks:
                if t.done():
                    t.result()  # raises the server's startup error
                    raise RuntimeError("an emulated engine's HTTP server exited during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop the servers, the engines and the publishers."""
        for e in self.engines:
            e.server.should_exit = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for e in self.engines:
            await e.runner.stop()
            e.publisher.close()

    async def wait(self) -> None:
        """Until every server has exited."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


class FleetThread:
    """A Fleet on its own event loop in a daemon thread (for tests and embedding).

    call(fn) runs fn() on the fleet's loop and returns its result, so the engines' state
    can be read without racing the loop.
    """

    def __init__(self, ports: list[EnginePorts], opts: EmulatorOptions | None = None) -> None:
        self._ports = ports
        self._opts = opts
        self.fleet: Fleet | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvroute-emulate", daemon=True)

    def start(self) -> FleetThread:
        """Start the loop thread and the fleet; returns when every engine listens."""
        self._thread.start()

        async def make() -> Fleet:
            fleet = Fleet(self._ports, self._opts)
            await fleet.start()
            return fleet

        self.fleet = asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)
        return self

    def call(self, fn: Any, timeout: float = 30) -> Any:
        """fn() evaluated on the fleet's loop."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        """Stop the fleet and the loop thread."""
        if self.fleet is not None:
            asyncio.run_coroutine_threadsafe(self.fleet.stop(), self.loop).result(30)
            self.fleet = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> FleetThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def engine_fields() -> list[dataclasses.Field[Any]]:
    """EngineConfig's fields (the emulator's engine parameters)."""
    from ..sim.engine import EngineConfig

    return list(dataclasses.fields(EngineConfig))


__all__ = ["EmulatedEngine", "EmulatorOptions", "EnginePorts", "Fleet", "FleetThread", "engine_fields"]
