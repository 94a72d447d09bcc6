"""Processes and servers the gateway tests start and stop: fake engines (tests/fake_engine.py)
as subprocesses on free ports, and the gateway itself in a thread (uvicorn on its own loop)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def emulated_fleet(n: int = 4, time_scale: float = 0.02) -> Iterator[Any]:
    """n emulated engines (kvroute.emulate, in a thread) on free ports, for a module fixture:
    yields the running FleetThread and stops it after."""
    from kvroute.emulate import EmulatorOptions, EnginePorts, FleetThread

    ports = [EnginePorts(free_port(), free_port(), free_port()) for _ in range(n)]
    f = FleetThread(ports, EmulatorOptions(time_scale=time_scale)).start()
    try:
        yield f
    finally:
        f.stop()


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET url -> decoded JSON."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def call(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, decoded JSON) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def wait_until(pred: Any, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Poll pred() until true; False after timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(interval)
    return False

_OPEN_CLIENTS: list[Any] = []  # closed by close_openai_clients() after each test (conftest.py)


def openai_client(server: Any, **kw: Any) -> Any:
    """The official openai client pointed at a gateway or engine (an object with .url, or the
    URL itself), with no retries so a test sees every error. It is closed after the test: an
    unclosed client's pooled socket can be finalised during a later test, whose ResourceWarning
    then fails that unrelated test."""
    import openai

    url = server if isinstance(server, str) else server.url
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, **kw)
    _OPEN_CLIENTS.append(c)
    return c


def close_openai_clients() -> None:
    """Close every client openai_client() handed out."""
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


def metrics_of(gw: Any) -> dict[str, dict[tuple, float]]:
    """The gateway's /metrics parsed by prometheus_client: sample name -> labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(gw.url + "/metrics").read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out



class Engine:
    """One fake engine process."""

    def __init__(self, name: str, port: int | None = None, **flags: Any) -> None:
        self.name, self.port, self.flags = name, port or free_port(), flags
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Engine:
        args = [sys.executable, os.path.join(ROOT, "tests", "fake_engine.py"), "--port", str(self.port),
                "--name", self.name]
        for k, v in self.flags.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(args, env=env)
        return self

    def wait(self) -> Engine:
        if not wait_until(lambda: get_json(self.url + "/stats", 1.0) is not None, 30):
            raise RuntimeError(f"engine {self.name} did not start")
        return self

    def stats(self) -> dict[str, Any]:
        return dict(get_json(self.url + "/stats"))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class GatewayThread:
    """A Gateway served by uvicorn on a thread; `app` is the Gateway."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        from kvroute.gateway.app import Gateway
        from kvroute.gateway.server import uvicorn_config

        self.config = config
        self.app = Gateway(config)
        self.server = uvicorn.Server(uvicorn_config(self.app, config))
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self) -> GatewayThread:
        self.thread.start()
        if not wait_until(lambda: self.server.started, 20):
            raise RuntimeError("gateway did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
