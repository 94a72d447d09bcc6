"""kvroute inside Ray Serve: a RequestRouter that routes by KV-cache affinity.

One line on a deployment (Ray >= 2.46, `pip install kvroute[ray]`):

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="kvroute.integrations.ray:KvrouteRequestRouter",
        request_router_kwargs={"policy": "ttft"}))

request_router_kwargs (all optional; see RayRouterSettings): policy, params, mode,
block_size, tokenizer (None: tokenizer-free text mode), text_block_bytes, session_key,
seed, request_ttl, index_capacity, index_ttl, max_requests.

Follows the conventions of Ray's own routers: the mixins as peers
(`PowerOfTwoChoicesRequestRouter` in ray/serve/_private/request_router/pow_2_router.py and
`PrefixCacheAffinityRouter` in ray/llm/_internal/serve/routing_policies/prefix_aware/
prefix_aware_router.py), no FIFOMixin (as the prefix router: a replica chosen for a
request's prompt must serve that request, so Ray matches by internal_request_id), the
candidate set narrowed by `apply_multiplex_routing` / `apply_locality_routing`.
`choose_replicas` returns ranks: [[kvroute's choice], [the other candidates]]; Ray takes
the first rank whose replica accepts (by queue length) and falls to the next otherwise.

Unlike Ray's prefix router, whose character tree lives in a separate actor reached with a
blocking `ray.get` on every decision and every routed request, kvroute's index lives in
the router's own process: a decision is one in-process `Router.route` call.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from .ray_core import RayRouterSettings, RayRoutingCore, instances, rank_replicas, register


class KvrouteRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve RequestRouter backed by one kvroute Router (see the module doc)."""

    core: RayRoutingCore

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Ray with request_router_kwargs: build the kvroute Router."""
        self.core = RayRoutingCore(RayRouterSettings(**kwargs))
        self.core.sync_replicas(self._replicas)
        register(self)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """Ray's replica set changed: kvroute's follows (added ones join, gone ones leave)."""
        super().update_replicas(replicas)
        if hasattr(self, "core"):
            self.core.sync_replicas(self._replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica died: drop it from Ray's set and kvroute's (index and load)."""
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "core"):
            self.core.replica_gone(replica_id)

    def on_new_queue_len_info(self, replica_id: ReplicaID, num_ongoing_requests: int) -> None:
        """Ray's queue length for a replica: Ray's cache and kvroute's reported load."""
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self.core.queue_len(replica_id, num_ongoing_requests)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        """[[kvroute's choice], [the other candidates]]: one kvroute decision per call."""
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [list(candidate_replicas)]
        meta = pending_request.metadata
        model_id = meta.multiplexed_model_id or None
        preferred = (
            self.apply_multiplex_routing(pending_request=pending_request)
            if model_id
            else self.apply_locality_routing(pending_request=pending_request)
        )
        chosen_id = self.core.decide(
            meta.internal_request_id, pending_request.args, pending_request.kwargs,
            session_id=getattr(meta, "session_id", None), model_id=model_id,
        )
        return rank_replicas(candidate_replicas, chosen_id, preferred)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """The replica Ray actually used: an override releases kvroute's reservation."""
        self.core.routed(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended: kvroute's Router.finish."""
        self.core.completed(replica_id, internal_request_id)


__all__ = ["KvrouteRequestRouter", "instances", "rank_replicas"]
