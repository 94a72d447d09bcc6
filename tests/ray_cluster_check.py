"""KvrouteRequestRouter on a real local Ray cluster (run by tests/test_ray_router.py).

ray.init(num_cpus=2), a Serve deployment of 4 SimEngineReplica replicas (kvroute.sim.engine,
so prefix hits are real) routed by KvrouteRequestRouter; checks that unrelated prompts spread
at concurrency 1, shared-prefix requests reuse one replica's cache, sessions stay put, a
killed replica is dropped while requests continue, and the accounting returns to zero.
Prints OK and exits 0 on success; an AssertionError otherwise. Stops the cluster itself.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvroute.integrations.ray_core import instances
from kvroute.integrations.ray_engine import SimEngineReplica


def words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{v}" for v in rng.integers(0, 10**6, n))


def deploy() -> Any:
    dep = serve.deployment(
        SimEngineReplica, num_replicas=4, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="kvroute.integrations.ray:KvrouteRequestRouter",
            request_router_kwargs={"policy": "ttft", "session_key": "user"},
        ),
    )
    return serve.run(dep.bind(num_kv_blocks=2048, time_scale=1.0), name="kv", route_prefix=None)


def wait_for(cond: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(cond())


def check() -> None:
    handle = deploy()
    call = lambda req: handle.remote(req).result(timeout_s=60)  # noqa: E731
    seen = {call({"prompt": words(1000 + i, 200), "max_tokens": 2})["replica"] for i in range(4)}
    assert len(seen) == 4, f"unrelated prompts at concurrency 1 went to {seen}"
    (router,) = [r for r in instances() if r.core.router.replicas]
    system = words(7, 500)
    outs = [call({"prompt": system + f" q{i} " + words(i, 10), "max_tokens": 2}) for i in range(5)]
    assert len({o["replica"] for o in outs}) == 1, outs
    assert all(o["cached_tokens"] >= len(system) - 32 for o in outs[1:]), outs
    sess = {call({"prompt": words(300 + i, 100), "user": "alice", "max_tokens": 2})["replica"] for i in range(4)}
    assert len(sess) == 1, sess
    victim = outs[0]["replica"]
    rid = next(r for r in router.curr_replicas if r.unique_id == victim)
    ray.kill(ray.get_actor(rid.to_full_id_str(), namespace="serve"), no_restart=True)
    results = [call({"prompt": system + f" after {i}", "max_tokens": 2}) for i in range(6)]
    assert all(r["replica"] != victim for r in results), results
    assert wait_for(lambda: victim not in router.core.router.replicas, 60), router.core.router.replicas
    assert wait_for(lambda: router.core.router.stats()["in_flight"] == 0, 10), router.core.stats()
    st = router.core.stats()
    assert st["router_in_flight"] == 0 and st["in_flight"] == 0 and st["decisions"] >= 19 and st["completed"] >= 19, st
    serve.delete("kv")


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="Disabled")
        check()
    finally:
        serve.shutdown()
        ray.shutdown()
    print("OK")


if __name__ == "__main__":
    main()
