"""Ray Serve request routers with their routing time measured (for bench_ray.py).

Each class times what the router does per request in the handle's process:
`choose_replicas` (Ray's prefix router: its queue-length probes and its blocking
`ray.get` to the prefix-tree actor; kvroute: one Router.route) plus `on_request_routed`
(Ray's prefix router: a blocking `ray.get` inserting the prompt into the tree). Instances
register in kvroute.integrations.ray_core (a module Ray pickles by reference), so the
benchmark finds them although Ray ships these classes to the handle by value.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
# ray.serve.llm.request_router re-exports it but needs ray[llm] (pyarrow); the class itself does not.
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from kvroute.integrations.ray import KvrouteRequestRouter
from kvroute.integrations.ray_core import register


class _Timed:
    route_ns = 0
    route_calls = 0
    routed_calls = 0

    def _start(self) -> int:
        if "route_ns" not in self.__dict__:
            self.route_ns = self.route_calls = self.routed_calls = 0
            register(self)
        return time.perf_counter_ns()

    async def choose_replicas(self, candidate_replicas: Any, pending_request: Any = None) -> Any:
        t0 = self._start()
        out = await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[misc]
        self.route_ns += time.perf_counter_ns() - t0
        self.route_calls += 1
        return out

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        t0 = self._start()
        super().on_request_routed(pending_request, replica_id, result)  # type: ignore[misc]
        self.route_ns += time.perf_counter_ns() - t0
        self.routed_calls += 1


class TimedKvroute(_Timed, KvrouteRequestRouter):
    """KvrouteRequestRouter, timed."""


class TimedPrefix(_Timed, PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter, timed."""


class TimedPow2(_Timed, PowerOfTwoChoicesRequestRouter):
    """Ray's default power-of-two-choices router, timed."""
