"""The gateway's replicas: router membership, circuit breakers, KV-event subscribers, and the
engine-reported load and models, behind add / remove / drain (the admin API calls these)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from .. import block_hashes
from .breaker import CLOSED, Breaker
from .config import GatewayConfig, ReplicaSpec
from .metrics import GatewayMetrics, ReplicaMetrics

log = logging.getLogger("kvroute.gateway")


def hash_prompt(tokens: Any, block_size: int, salt: str | None, lora: str | None, cache_salt: str | None,
                mm: list[tuple[str, int, int]] | None) -> Any:
    """kvroute.block_hashes with the request's cache keys (contract C1)."""
    return block_hashes(tokens, block_size, salt=salt, lora=lora, cache_salt=cache_salt, mm=mm)


def add_to_router(router: Any, spec: ReplicaSpec) -> int:
    """Router.add_replica with the engine block size (contract C2)."""
    return int(router.add_replica(spec.name, engine_block_size=spec.block_size))


@dataclasses.dataclass
class Replica:
    """One replica's gateway-side state."""

    spec: ReplicaSpec
    id: int
    metrics: ReplicaMetrics
    breaker: Breaker
    subscriber: Any = None
    record_routes: bool = False
    models: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lora: set[str] = dataclasses.field(default_factory=set)
    reported: dict[str, Any] = dataclasses.field(default_factory=dict)
    scrape_errors: int = 0
    in_flight: int = 0


class Fleet:
    """Replicas by name; every change goes through here so router, breakers, subscribers
    and metrics agree."""

    def __init__(self, router: Any, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics
        self.replicas: dict[str, Replica] = {}
        self.lora_models: frozenset[str] = frozenset(config.lora_models)
        # One EventApplier for every subscriber (precise/hybrid), so a snapshot saves its maps at once.
        self.applier: Any = None
        if router.config.mode != "approximate":
            from ..events import EventApplier

            self.applier = EventApplier(router.index, router.config.block_size, salt=config.salt)

    def add(self, spec: ReplicaSpec, *, follow: bool = True) -> Replica:
        """Add a replica (and, with follow, its events in precise/hybrid mode: see `follow`);
        ValueError if the name exists."""
        if spec.name in self.replicas:
            raise ValueError(f"replica '{spec.name}' already exists")
        mode = self.router.config.mode
        rid = add_to_router(self.router, spec)
        rep = Replica(spec, rid, self.metrics.replica(spec.name),
                      Breaker(self.config.breaker_backoff, self.config.breaker_max_backoff),
                      # approximate mode records every route itself; hybrid's own records expire
                      # after speculative_ttl, too soon for a replica with no events at all
                      record_routes=mode != "approximate" and spec.events is None)
        rep.metrics.breaker_state(CLOSED)
        self.replicas[spec.name] = rep
        if follow:
            try:
                self.follow(rep)
            except Exception:
                del self.replicas[spec.name]
                self.router.remove_replica(spec.name)
                self.metrics.forget(spec.name)
                raise
        return rep

    def follow(self, rep: Replica, resume: dict[str, int] | None = None) -> None:
        """Start following a replica's KV events (precise/hybrid mode and events=); `resume`
        ({"seq", "digest"} of the last batch a restored snapshot holds) replays from there
        (contract C8) instead of taking the engine's state as unknown."""
        if rep.spec.events is None or self.router.config.mode == "approximate" or rep.subscriber is not None:
            return
        rep.subscriber = self._subscribe(rep.id, rep.spec, resume)

    def _subscribe(self, rid: int, spec: ReplicaSpec, resume: dict[str, int] | None) -> Any:
        from ..events import Source, Subscriber

        assert spec.events is not None and self.applier is not None
        kw = {} if resume is None else {"resume": {rid: dict(resume)}}
        return Subscriber(self.applier, [Source(rid, spec.events, replay_endpoint=spec.replay)], **kw).start()

    @contextlib.contextmanager
    def paused(self) -> Iterator[dict[str, dict[str, int]]]:
        """Hold every subscriber between batches (Subscriber.paused) and yield {replica name:
        {"seq", "digest"}} of the last batch applied per followed replica: inside the block the
        applier's state is exactly what those cursors name. Keep it short: events queue."""
        with contextlib.ExitStack() as stack:
            out = {}
            for name, rep in list(self.replicas.items()):
                if rep.subscriber is not None:
                    cur = stack.enter_context(rep.subscriber.paused()).get(rep.id)
                    if cur is not None:
                        out[name] = {"seq": int(cur["seq"]), "digest": int(cur["digest"])}
            yield out

    def remove(self, name: str) -> None:
        """Remove a replica: its subscriber stops, its index blocks and in-flight accounting go."""
        rep = self.get(name)
        if rep.subscriber is not None:
            rep.subscriber.stop()
        if self.applier is not None:
            self.applier.clear_replica(rep.id)
        self.router.remove_replica(name)
        del self.replicas[name]
        self.metrics.forget(name)
        self._refresh_lora()

    def drain(self, name: str, draining: bool = True) -> None:
        """Stop (or resume) routing new requests to a replica; requests in flight finish."""
        self.get(name)
        self.router.drain(name, draining)

    def get(self, name: str) -> Replica:
        """The replica named `name`; KeyError naming it otherwise."""
        rep = self.replicas.get(name)
        if rep is None:
            raise KeyError(f"no replica named '{name}'")
        return rep

    def failure(self, rep: Replica, kind: str) -> None:
        """A request or probe failed on `rep`: count it and open its breaker."""
        self.metrics.upstream_errors.labels(rep.spec.name, kind).inc()
        if rep.breaker.failure(time.monotonic()):
            rep.metrics.breaker_opened.inc()
            log.warning("replica %s: breaker open for %.1fs (%s)", rep.spec.name, rep.breaker.period, kind)
        self._sync_health(rep)

    def probe_result(self, rep: Replica, ok: bool) -> None:
        """A /health probe's outcome."""
        if not ok:
            self.failure(rep, "health")
        elif rep.breaker.success():
            log.warning("replica %s: breaker closed", rep.spec.name)
        self._sync_health(rep)

    def _sync_health(self, rep: Replica) -> None:
        if rep.spec.name in self.replicas:
            self.router.set_healthy(rep.spec.name, rep.breaker.routable)
        rep.metrics.breaker_state(rep.breaker.state)

    def set_models(self, rep: Replica, models: list[dict[str, Any]], lora: set[str]) -> None:
        """Record a replica's /v1/models answer."""
        rep.models, rep.lora = models, lora
        self._refresh_lora()

    def _refresh_lora(self) -> None:
        learned = set().union(*(r.lora for r in self.replicas.values())) if self.replicas else set()
        self.lora_models = frozenset(self.config.lora_models) | learned

    def events_status(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, subscriber counters) of every followed replica (for /metrics and the admin API)."""
        out = []
        for name, rep in list(self.replicas.items()):
            if rep.subscriber is not None:
                st = rep.subscriber.status()
                out.append((name, st["replicas"].get(rep.id, {})))
        return out

    def describe(self, rep: Replica) -> dict[str, Any]:
        """A replica for GET /kvroute/replicas."""
        load = self.router.load(rep.spec.name)
        events = None
        if rep.subscriber is not None:
            st = rep.subscriber.status()["replicas"].get(rep.id, {})
            events = {k: st.get(k) for k in ("batches", "lag", "gaps", "resyncs", "malformed", "last_seq")}
        return {
            "name": rep.spec.name, "url": rep.spec.url, "id": rep.id,
            "events": rep.spec.events, "replay": rep.spec.replay,
            "knowledge": "events" if rep.subscriber is not None else "routes",
            "health": rep.breaker.state, "routable": rep.breaker.routable, "draining": load["draining"],
            "in_flight": rep.in_flight, "load": load, "reported": rep.reported,
            "blocks_held": int(self.router.index.blocks(rep.id)),
            "events_status": events, "models": [m["id"] for m in rep.models],
        }

    def stop_following(self) -> None:
        """Stop every subscriber (their cursors stay readable, for the last snapshot)."""
        for rep in self.replicas.values():
            if rep.subscriber is not None:
                rep.subscriber.stop()

    def close(self) -> None:
        """Stop every subscriber and let go of them."""
        self.stop_following()
        for rep in self.replicas.values():
            rep.subscriber = None
