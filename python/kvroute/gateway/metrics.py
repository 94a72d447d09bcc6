"""The gateway's Prometheus metrics (all under kvroute_), in a registry of their own.

Per-replica children are resolved once per replica (ReplicaMetrics) so the request path
does no label lookups; events applied and lag are read from the subscribers at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .breaker import STATE_CODE

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                     2.5e-2, 5e-2, 0.1, 0.25, 1.0)
STAGES = ("tokenize", "hash", "score")


class ReplicaMetrics:
    """One replica's metric children."""

    def __init__(self, m: GatewayMetrics, name: str) -> None:
        self.in_flight = m.in_flight.labels(name)
        self.predicted = m.predicted.labels(name)
        self.reported = m.reported.labels(name)
        self.reported_requests = m.reported_requests.labels(name)
        self.retries = m.retries.labels(name)
        self.breaker = m.breaker_state.labels(name)
        self.breaker_opened = m.breaker_opened.labels(name)
        self._requests = m.requests
        self._name = name
        self._by_reason: dict[str, Any] = {}

    def request(self, reason: str) -> None:
        """Count one routed request."""
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._requests.labels(self._name, reason)
        child.inc()

    def breaker_state(self, state: str) -> None:
        """Set the breaker-state gauge."""
        self.breaker.set(STATE_CODE[state])


class GatewayMetrics:
    """All metrics; `render()` is the /metrics body."""

    def __init__(self, events_status: Callable[[], Iterable[tuple[str, dict[str, Any]]]] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvroute_requests", "Requests routed, by replica and decision reason",
                                ["replica", "reason"], registry=r)
        self.decision = Histogram("kvroute_decision_seconds", "Routing decision time by stage",
                                  ["stage"], buckets=_DECISION_BUCKETS, registry=r)
        self.stage = {s: self.decision.labels(s) for s in STAGES}
        self.in_flight = Gauge("kvroute_in_flight", "Requests in flight per replica", ["replica"], registry=r)
        self.predicted = Counter("kvroute_predicted_cached_tokens",
                                 "Cached prompt tokens the router predicted, for requests whose engine "
                                 "reported usage.prompt_tokens_details.cached_tokens", ["replica"], registry=r)
        self.reported = Counter("kvroute_reported_cached_tokens", "Cached prompt tokens the engine reported",
                                ["replica"], registry=r)
        self.reported_requests = Counter("kvroute_reported_usage_requests",
                                         "Requests whose engine reported cached tokens", ["replica"], registry=r)
        self.retries = Counter("kvroute_retries", "Requests re-routed after a failure on this replica",
                               ["replica"], registry=r)
        self.upstream_errors = Counter("kvroute_upstream_errors", "Upstream failures by kind",
                                       ["replica", "kind"], registry=r)
        self.breaker_state = Gauge("kvroute_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open",
                                   ["replica"], registry=r)
        self.breaker_opened = Counter("kvroute_breaker_opened", "Times the breaker opened", ["replica"], registry=r)
        self.disconnects = Counter("kvroute_client_disconnects", "Requests the client abandoned (upstream cancelled)",
                                   registry=r)
        self.failed = Counter("kvroute_failed_requests", "Requests answered with a gateway error", ["status"],
                              registry=r)
        self.tokenizer_reuse = Counter("kvroute_tokenizer_reused_tokens",
                                       "Prompt tokens taken from a session's previous turn", registry=r)
        self.tokenizer_encoded = Counter("kvroute_tokenizer_encoded_tokens", "Prompt tokens tokenized", registry=r)
        self._replicas: dict[str, ReplicaMetrics] = {}
        r.register(_EventsCollector(events_status or (lambda: ()), self._replicas))

    def enable_state(self) -> None:
        """Register the shared-state series (--state redis://): link health, errors, drops,
        peers, staleness. Called once by the Redis backend; a local gateway has none."""
        if hasattr(self, "state_up"):
            return
        r = self.registry
        self.state_up = Gauge("kvroute_state_redis_up", "1 while the shared-state Redis answers (0: going on "
                              "with local state)", registry=r)
        self.state_errors = Counter("kvroute_state_redis_errors", "Redis commands that failed or timed out, by "
                                    "operation", ["op"], registry=r)
        self.state_outages = Counter("kvroute_state_redis_outages", "Times the Redis link went down", registry=r)
        self.state_dropped = Counter("kvroute_state_dropped_writes", "Session and route writes not shared "
                                     "(Redis down, failed or queue full)", registry=r)
        self.state_peers = Gauge("kvroute_state_peers", "Other gateways whose load record is live", registry=r)
        self.state_load_age = Gauge("kvroute_state_load_age_seconds", "Age of the oldest live peer load record "
                                    "at the last read", registry=r)
        self.state_route_delay = Histogram("kvroute_state_route_delay_seconds", "Another gateway's route-time "
                                           "insert: Redis stream entry time to applied here", registry=r,
                                           buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                                                    1.0))

    def replica(self, name: str) -> ReplicaMetrics:
        """The children of one replica (created on first use)."""
        m = self._replicas.get(name)
        if m is None:
            m = self._replicas[name] = ReplicaMetrics(self, name)
        return m

    def forget(self, name: str) -> None:
        """Drop a removed replica's series."""
        m = self._replicas.pop(name, None)
        if m is None:
            return
        for metric in (self.in_flight, self.predicted, self.reported, self.reported_requests, self.retries,
                       self.breaker_state, self.breaker_opened):
            try:
                metric.remove(name)
            except KeyError:
                pass
        for reason in list(m._by_reason):
            self.requests.remove(name, reason)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


class _EventsCollector:
    """Events applied, lag and the prediction ratio, computed at scrape time."""

    def __init__(self, status: Callable[[], Iterable[tuple[str, dict[str, Any]]]],
                 replicas: dict[str, ReplicaMetrics]) -> None:
        self._status = status
        self._replicas = replicas

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        applied = CounterMetricFamily("kvroute_events_batches", "KV event batches applied per replica",
                                      labels=["replica"])
        lag = GaugeMetricFamily("kvroute_events_lag_seconds", "Now minus the engine timestamp of the last "
                                "applied batch", labels=["replica"])
        resyncs = CounterMetricFamily("kvroute_events_resyncs", "Replica cleared after an unrecoverable gap",
                                      labels=["replica"])
        for name, st in self._status():
            applied.add_metric([name], st.get("batches", 0))
            resyncs.add_metric([name], st.get("resyncs", 0))
            if st.get("lag") is not None:
                lag.add_metric([name], st["lag"])
        ratio = GaugeMetricFamily("kvroute_cache_calibration_ratio", "Engine-reported over predicted cached "
                                  "tokens (1 = calibrated, < 1 over-claimed, > 1 under-claimed)", labels=["replica"])
        for name, m in list(self._replicas.items()):
            predicted = m.predicted._value.get()
            if predicted > 0:
                ratio.add_metric([name], m.reported._value.get() / predicted)
        return [applied, lag, resyncs, ratio]
