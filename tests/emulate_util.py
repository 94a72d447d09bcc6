"""Helpers for the emulator's end-to-end tests: free loopback ports, a fleet in a thread
that records every KV event its engines publish, and polling with a bound."""

from __future__ import annotations

import socket
import time
from collections import Counter
from typing import Any, Callable

WAIT = 30.0  # seconds; a bound on a loaded 2-core machine, never reached when things work


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_fleet(n: int, **opts: Any) -> Any:
    """A FleetThread of n engines on free ports; `.published[i]` lists engine i's events."""
    from kvroute.emulate import EmulatorOptions, EnginePorts, FleetThread

    ports = free_ports(3 * n)
    engines = [EnginePorts(ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]) for i in range(n)]
    ft = FleetThread(engines, EmulatorOptions(**opts)).start()
    ft.published = [[] for _ in range(n)]

    def record() -> None:
        for e, log in zip(ft.fleet.engines, ft.published):
            send = e.runner.publish
            e.runner.publish = lambda events, send=send, log=log: (log.extend(events), send(events))

    ft.call(record)
    return ft


def eventually(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll check() until it returns a true value; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def cache_content(events: list[Any]) -> Counter[int]:
    """Engine hash -> copies cached, replaying the engine's own events (a naive model:
    every BlockStored adds a copy of each hash, every BlockRemoved takes one away)."""
    out: Counter[int] = Counter()
    for ev in events:
        kind = type(ev).__name__
        if kind == "BlockStored":
            out.update(int(h) for h in ev.block_hashes)
        elif kind == "BlockRemoved":
            out.subtract(int(h) for h in ev.block_hashes)
        elif kind == "AllBlocksCleared":
            out.clear()
    return +out


def kvroute_hashes(events: list[Any], block_size: int = 16) -> dict[int, int]:
    """Engine hash -> kvroute's hash of the same block (README "Block hashing", no salt),
    following each BlockStored's chain from its parent."""
    import numpy as np
    import xxhash

    root = xxhash.xxh3_64_intdigest(b"", seed=0)
    kv: dict[int, int] = {}
    for ev in events:
        if type(ev).__name__ != "BlockStored":
            continue
        h = root if ev.parent_block_hash is None else kv[int(ev.parent_block_hash)]
        tokens = np.asarray(ev.token_ids, dtype="<u4")
        for i, eh in enumerate(ev.block_hashes):
            h = xxhash.xxh3_64_intdigest(tokens[i * block_size:(i + 1) * block_size].tobytes(), seed=h)
            kv[int(eh)] = h
    return kv
