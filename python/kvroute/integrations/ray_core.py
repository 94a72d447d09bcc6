"""The Ray-free core of KvrouteRequestRouter: one kvroute Router fed by Ray's callbacks.

Ray Serve's RequestRouter API (ray/serve/_private/request_router/request_router.py) calls
`choose_replicas` once per routing attempt, then `on_request_routed` when a replica
accepted the request (only with Ray's queue-length "rejection protocol", on by default
outside Ray Client, ray/serve/_private/router.py), `on_request_completed` when it ended
however it ended, `on_new_queue_len_info` with a replica's ongoing-request count, and
`update_replicas` / `on_replica_actor_died` when the replica set changes. This class maps
those onto kvroute's lifecycle, keyed by Ray's `internal_request_id` (unique per
request, RequestMetadata in ray/serve/_private/common.py):

- decide(): one `Router.route` (reserve at decision). A second decide() for the same
  request (Ray retries after a rejection or when no rank could take it) first releases
  the previous reservation (counted as "retried").
- routed(): if Ray sent the request to another replica than kvroute chose (kvroute's
  choice was full and Ray fell back to a later rank), the reservation is released and
  counted as "overridden": kvroute then does not account that request's load. In
  approximate mode the index already holds the prompt on kvroute's choice; the public
  Router API cannot take that back, so an override can over-claim there until the
  index's TTL/capacity ages it out; `stats()["overridden"]` says how often.
- completed(): `Router.finish`. A completion naming another replica than the current
  reservation is a late completion of an earlier, rejected attempt and is ignored.
- Requests never completed are released by the Router's `request_ttl`; this class's own
  table drops entries older than `request_ttl` too, and holds at most `max_requests`
  (oldest dropped first), so every table here is bounded.
- Estimated first token: Ray's router never sees a request's first token, and a request
  still counted as prefilling until it completes would overstate a replica's queued
  prefill by its whole decode time. So each decision also records when the prefill
  should be done under kvroute's own FIFO model (the replica's queued prefill tokens,
  this request's included, over `prefill_rate`), and `Router.prefill_done` is called once
  that time has passed (checked at each decision; `estimate_prefill=False` turns it off,
  leaving requests prefilling until they complete). Counted as "estimated_prefills".
- queue_len(): `Router.report_load(name, waiting=n)`: Ray's ongoing-request count is the
  replica's queue as Ray sees it (used by the llmd policy's queue term).

Replica names in kvroute are Ray's `ReplicaID.unique_id` (any hashable id with a
`unique_id` attribute; else `str(id)`).
"""

from __future__ import annotations

import heapq
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from .. import Router, RouterConfig
from .ray_keys import KeyExtractor, PromptKey

# Ray ships a custom router class to each handle by value (cloudpickle with its module
# registered by value, ray/serve/config.py), which copies that module's globals; this
# module is pickled by reference, so the registry below is the process's one registry.
_ROUTERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(router: Any) -> None:
    """Record a live KvrouteRequestRouter (see instances())."""
    _ROUTERS.add(router)


def instances() -> list[Any]:
    """The KvrouteRequestRouter objects alive in this process (Ray builds one per
    deployment handle or proxy), for stats, benchmarks and tests."""
    return list(_ROUTERS)


#: Default bound on the table of reservations kept for Ray requests in flight.
MAX_REQUESTS = 100_000


@dataclass
class _Reservation:
    handle: int
    replica: Hashable
    at: float
    released: bool = False
    prefilled: bool = False


def replica_name(replica_id: Any) -> str:
    """kvroute's name for a Ray replica id: its unique_id, else str(id)."""
    uid = getattr(replica_id, "unique_id", None)
    return uid if isinstance(uid, str) else str(replica_id)


@dataclass(frozen=True)
class RayRouterSettings:
    """request_router_kwargs of KvrouteRequestRouter, validated.

    policy, params, mode, seed, request_ttl, index_capacity, index_ttl: as RouterConfig.
    block_size: tokens per block when routing token ids (a tokenizer is configured).
    tokenizer: None (tokenizer-free text mode), "builtin" (kvroute's byte tokenizer) or a
    Hugging Face tokenizer path. text_block_bytes: bytes per block in text mode (the
    Router's block size when no tokenizer is set). session_key: request field with a
    session id (Ray's own session_id always wins). max_requests: bound on the reservation
    table. prefill_rate: tokens (text mode: bytes) per second a replica prefills, for the
    ttft policy and the estimated first token; estimate_prefill: see the module doc.
    """

    policy: str = "ttft"
    params: Mapping[str, Any] | None = None
    block_size: int = 16
    mode: str = "approximate"
    tokenizer: str | None = None
    text_block_bytes: int = 64
    session_key: str | None = None
    seed: int = 0
    request_ttl: float = 600.0
    index_capacity: int | None = None
    index_ttl: float | None = None
    max_requests: int = MAX_REQUESTS
    prefill_rate: float = 10_000.0
    estimate_prefill: bool = True

    def router_config(self) -> RouterConfig:
        """The RouterConfig these settings give (its block is bytes in text mode)."""
        for name in ("text_block_bytes", "max_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        bs = self.block_size if self.tokenizer is not None else self.text_block_bytes
        return RouterConfig(
            policy=self.policy, params=dict(self.params or {}), block_size=bs, mode=self.mode,
            seed=self.seed, request_ttl=self.request_ttl, index_capacity=self.index_capacity,
            index_ttl=self.index_ttl, prefill_rate=self.prefill_rate,
        )


class RayRoutingCore:
    """kvroute's Router plus the bookkeeping that ties it to Ray's request ids."""

    def __init__(self, settings: RayRouterSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.router = Router(settings.router_config())
        self.keys = KeyExtractor(settings.tokenizer, settings.session_key)
        self._clock = clock
        self._names: dict[Hashable, str] = {}
        self._ids: dict[str, Hashable] = {}
        self._requests: OrderedDict[str, _Reservation] = OrderedDict()
        # (estimated prefill end, sequence, request id, handle); stale entries are skipped.
        self._prefills: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self._stats = {
            "decisions": 0, "overridden": 0, "retried": 0, "completed": 0, "stale_completions": 0,
            "dropped": 0, "estimated_prefills": 0, "keys_tokens": 0, "keys_text": 0, "keys_none": 0, "route_ns": 0,
        }

    # -- replicas -----------------------------------------------------------------------

    def sync_replicas(self, replica_ids: Iterable[Hashable]) -> None:
        """Make kvroute's replica set exactly `replica_ids` (Ray's update_replicas)."""
        wanted = list(replica_ids)
        keep = set(wanted)
        for rid in [r for r in self._names if r not in keep]:
            self.replica_gone(rid)
        for rid in wanted:
            if rid not in self._names:
                name = replica_name(rid)
                self.router.add_replica(name)
                self._names[rid] = name
                self._ids[name] = rid

    def replica_gone(self, replica_id: Hashable) -> None:
        """A replica died or left: its index entries and load go (idempotent)."""
        name = self._names.pop(replica_id, None)
        if name is not None:
            del self._ids[name]
            self.router.remove_replica(name)

    def queue_len(self, replica_id: Hashable, num_ongoing: int) -> None:
        """Ray's queue-length info for a replica -> report_load(waiting=...)."""
        name = self._names.get(replica_id)
        if name is not None and isinstance(num_ongoing, int) and num_ongoing >= 0:
            self.router.report_load(name, waiting=num_ongoing)

    # -- requests -----------------------------------------------------------------------

    def decide(self, request_id: str, args: Sequence[Any], kwargs: Mapping[str, Any], *,
               session_id: str | None = None, model_id: str | None = None) -> Hashable | None:
        """One kvroute decision for a request; the chosen Ray replica id, or None when
        kvroute knows no replica. Reserves the request's load on the choice."""
        t0 = time.perf_counter_ns()
        self._release(request_id, "retried")
        if not self._names:
            return None
        key = self.keys.key(args, kwargs)
        session = self.keys.session(session_id, args, kwargs)
        now = self._clock()
        self._prune(now)
        self._estimated_prefills(now)
        d = self._route(key, session, model_id or None)
        rid = self._ids[d.replica]
        self._requests[request_id] = _Reservation(d.handle, rid, now)
        if self.settings.estimate_prefill:
            queued = self.router.load(d.replica)["queued_prefill_tokens"]
            self._seq += 1
            heapq.heappush(self._prefills, (now + queued / self.router.config.prefill_rate, self._seq,
                                            request_id, d.handle))
        self._stats["decisions"] += 1
        self._stats["keys_" + key.kind] += 1
        self._stats["route_ns"] += time.perf_counter_ns() - t0
        return rid

    def _route(self, key: PromptKey, session: str | None, lora: str | None) -> Any:
        return self.router.route(key.ids, session=session, lora=lora)

    def routed(self, request_id: str, replica_id: Hashable) -> None:
        """Ray sent the request to `replica_id`: if that is not kvroute's choice, release
        the reservation and count an override."""
        res = self._requests.get(request_id)
        if res is not None and not res.released and res.replica != replica_id:
            self._finish(res)
            self._stats["overridden"] += 1

    def completed(self, replica_id: Hashable, request_id: str) -> None:
        """The request ended on `replica_id`: release its reservation."""
        res = self._requests.get(request_id)
        if res is None:
            return
        if res.replica != replica_id and not res.released:
            self._stats["stale_completions"] += 1
            return
        del self._requests[request_id]
        if not res.released:
            self._finish(res)
        self._stats["completed"] += 1

    def _release(self, request_id: str, counter: str) -> None:
        res = self._requests.pop(request_id, None)
        if res is not None:
            if not res.released:
                self._finish(res)
            self._stats[counter] += 1

    def _finish(self, res: _Reservation) -> None:
        res.released = True
        try:
            self.router.finish(res.handle)
        except RuntimeError:
            pass  # already released by the Router's request_ttl: nothing left to free

    def _estimated_prefills(self, now: float) -> None:
        """prefill_done for reservations whose estimated prefill end has passed."""
        heap = self._prefills
        while heap and heap[0][0] <= now:
            _, _, request_id, handle = heapq.heappop(heap)
            res = self._requests.get(request_id)
            if res is None or res.handle != handle or res.released or res.prefilled:
                continue
            res.prefilled = True
            try:
                self.router.prefill_done(handle)
            except RuntimeError:
                continue  # expired by request_ttl meanwhile
            self._stats["estimated_prefills"] += 1
        if len(heap) > 2 * self.settings.max_requests:  # entries of finished requests
            heap[:] = [e for e in heap if e[2] in self._requests]
            heapq.heapify(heap)

    def _prune(self, now: float) -> None:
        """Drop reservations older than request_ttl, and the oldest beyond max_requests."""
        ttl, cap, reqs = self.settings.request_ttl, self.settings.max_requests, self._requests
        while reqs:
            rid, res = next(iter(reqs.items()))
            if res.at + ttl > now and len(reqs) < cap:
                break
            del reqs[rid]
            if not res.released:
                self._finish(res)
            self._stats["dropped"] += 1

    # -- introspection ------------------------------------------------------------------

    def in_flight(self) -> int:
        """Reservations still held (requests decided and not completed)."""
        return sum(1 for r in self._requests.values() if not r.released)

    def stats(self) -> dict[str, Any]:
        """This layer's counters plus the Router's (prefixed "router_")."""
        out: dict[str, Any] = dict(self._stats)
        out["tracked"] = len(self._requests)
        out["in_flight"] = self.in_flight()
        out.update({f"router_{k}": v for k, v in self.router.stats().items()})
        return out


def rank_replicas(candidates: Sequence[Any], chosen_id: Any, preferred: Any) -> list[list[Any]]:
    """Ranks for Ray: kvroute's choice alone, then the preferred (multiplex/locality)
    candidates, then the rest; empty ranks are left out."""
    first = [r for r in candidates if r.replica_id == chosen_id]
    rest = [r for r in candidates if r.replica_id != chosen_id]
    pref = set(preferred or ())
    near = [r for r in rest if r.replica_id in pref]
    far = [r for r in rest if r.replica_id not in pref]
    if pref and near:
        ranks = [first, near, far]
    else:
        ranks = [first, rest]
    return [rank for rank in ranks if rank]


__all__ = ["instances", "register", "rank_replicas", "RayRoutingCore", "RayRouterSettings", "replica_name", "MAX_REQUESTS"]
