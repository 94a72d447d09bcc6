"""`kvroute serve` settings: one dataclass, filled from a TOML file and then from flags.

Every flag has a TOML key of the same name with dashes as underscores (`--session-header`
-> `session_header`); replicas are `replica = ["URL,events=...", ...]` strings or
`[[replica]]` tables with the same keys (url, name, events, replay, block_size). Flags given
on the command line override the file; `--replica` flags replace the file's replicas.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..config import MODES, POLICY_PARAMS

_REPLICA_KEYS = ("name", "events", "replay", "block_size")


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """One engine: its HTTP base URL, a name (default: the URL's host:port), its KV-event PUB and replay
    endpoints (precise/hybrid knowledge; None: the gateway records its own routing decisions
    for it, approximate knowledge) and its engine block size in tokens (None: learned from events)."""

    url: str
    name: str = ""
    events: str | None = None
    replay: str | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"replica url must be http(s)://host:port, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", parts.netloc)
        for key in ("events", "replay"):
            value = getattr(self, key)
            if value is not None and "://" not in value:
                raise ValueError(f"replica {key} must be a ZMQ endpoint like tcp://host:port, got {value!r}")
        if self.replay is not None and self.events is None:
            raise ValueError("replica replay= needs events=")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size < 1):
            raise ValueError(f"replica block_size must be an int >= 1, got {self.block_size!r}")

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """`URL[,events=tcp://..][,replay=tcp://..][,name=..][,block_size=N]`."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("replica: empty")
        url, *rest = [p.strip() for p in text.split(",")]
        kv: dict[str, Any] = {}
        for item in rest:
            key, sep, value = item.partition("=")
            if not sep or key not in _REPLICA_KEYS:
                raise ValueError(f"replica {text!r}: unknown option {item!r} (known: {', '.join(_REPLICA_KEYS)})")
            kv[key] = int(value) if key == "block_size" else value
        return cls(url, **kv)

    @classmethod
    def from_toml(cls, item: Any) -> ReplicaSpec:
        """A TOML replica: a string as for --replica, or a table."""
        if isinstance(item, str):
            return cls.parse(item)
        if isinstance(item, Mapping):
            unknown = set(item) - {"url", *_REPLICA_KEYS}
            if unknown or "url" not in item:
                raise ValueError(f"replica table needs 'url' and takes {', '.join(_REPLICA_KEYS)}; got {sorted(item)}")
            return cls(**dict(item))
        raise ValueError(f"replica must be a string or a table, got {type(item).__name__}")


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Gateway settings (defaults are the flags' defaults).

    mode: None chooses "precise" when every replica has events=, else "approximate";
    replicas without events= are recorded at route time in every mode. tokenizer: None for
    the built-in byte tokenizer, "engine" for the engines' /tokenize, else a Hugging Face
    tokenizer folder. Times in seconds. retries: re-routes after a failure before any byte
    reached the client (the issue asks for one). lora_models: model names that are LoRA
    adapters (also learned from /v1/models entries with a "parent"). state: None (or
    "local") shares nothing; redis://host:port/db shares sessions, load and route-time
    inserts with the other gateways on that Redis (kvroute.gateway.state); state_timeout
    bounds every Redis command. state_dir: where the router is snapshotted every
    snapshot_interval seconds and at shutdown, and restored from at start.
    """

    replicas: tuple[ReplicaSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 9000
    policy: str = "ttft"
    policy_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mode: str | None = None
    block_size: int = 16
    salt: str | None = None
    tokenizer: str | None = None
    session_header: str = "X-Session-ID"
    max_sessions: int = 4096
    scrape_interval: float = 1.0
    health_interval: float = 1.0
    connect_timeout: float = 2.0
    first_byte_timeout: float = 600.0
    read_timeout: float = 600.0
    retries: int = 1
    breaker_backoff: float = 1.0
    breaker_max_backoff: float = 30.0
    shutdown_timeout: float = 30.0
    lora_models: tuple[str, ...] = ()
    decision_log: str | None = None
    log_level: str = "warning"
    state: str | None = None
    state_timeout: float = 0.05
    state_prefix: str = "kvroute"
    state_load_interval: float = 0.1
    state_load_ttl: float = 2.0
    state_dir: str | None = None
    snapshot_interval: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in POLICY_PARAMS:
            raise ValueError(f"policy must be one of {', '.join(POLICY_PARAMS)}, got {self.policy!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for key in ("scrape_interval", "health_interval", "connect_timeout", "first_byte_timeout",
                    "read_timeout", "breaker_backoff", "breaker_max_backoff", "state_timeout",
                    "state_load_interval", "state_load_ttl", "snapshot_interval"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")
        if self.retries < 0 or self.max_sessions < 1:
            raise ValueError("retries must be >= 0 and max_sessions >= 1")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        if not self.session_header:
            raise ValueError("session_header must not be empty")
        if self.state is not None and self.state != "local" and not self.state.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"state must be 'local' or redis://host:port/db, got {self.state!r}")
        if self.state_load_ttl <= self.state_load_interval:
            raise ValueError("state_load_ttl must exceed state_load_interval")

    @property
    def routing_mode(self) -> str:
        """The Router's mode: `mode`, or the default described in the class docstring."""
        if self.mode is not None:
            return self.mode
        return "precise" if self.replicas and all(r.events for r in self.replicas) else "approximate"


_FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}


def _load_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = set(data) - set(_FIELDS) - {"replica"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: replica, {', '.join(_FIELDS)})")
    if "replica" in data:
        data["replicas"] = data.pop("replica")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvroute serve` flags (each default None, so that the TOML value stands)."""
    a = parser.add_argument
    a("--config", metavar="TOML", help="settings file; flags override it")
    a("--replica", action="append", metavar="URL[,events=tcp://..,replay=tcp://..,name=..,block_size=N]",
      help="an engine (repeat); without events= it is routed on the gateway's own records")
    a("--host", help="listen address (default 127.0.0.1)")
    a("--port", type=int, help="listen port (default 9000)")
    a("--policy", choices=list(POLICY_PARAMS), help="routing policy (default ttft)")
    a("--mode", choices=list(MODES), help="router knowledge (default: precise when every replica has events)")
    a("--block-size", type=int, help="router block size in tokens (default 16)")
    a("--salt", help="hash salt (namespaces a model)")
    a("--tokenizer", metavar="PATH|engine", help="Hugging Face tokenizer folder, 'engine' (/tokenize), "
                                                 "or unset: built-in byte tokenizer")
    a("--session-header", help="header naming the session (default X-Session-ID; else the body's 'user')")
    a("--max-sessions", type=int, help="sessions whose tokens are cached for incremental tokenization")
    a("--scrape-interval", type=float, help="seconds between /metrics scrapes (default 1)")
    a("--health-interval", type=float, help="seconds between /health probes (default 1)")
    a("--connect-timeout", type=float, help="upstream connect timeout (default 2 s)")
    a("--first-byte-timeout", type=float, help="upstream time to first body byte (default 600 s)")
    a("--read-timeout", type=float, help="upstream gap between body chunks (default 600 s)")
    a("--retries", type=int, help="re-routes before the first byte (default 1)")
    a("--breaker-backoff", type=float, help="first open period of a replica's breaker (default 1 s)")
    a("--breaker-max-backoff", type=float, help="longest open period (default 30 s)")
    a("--shutdown-timeout", type=float, help="graceful drain on SIGTERM (default 30 s)")
    a("--lora-models", help="comma-separated model names that are LoRA adapters")
    a("--decision-log", metavar="PATH", help="a JSON line per decision ('-' for stderr)")
    a("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    a("--state", metavar="redis://HOST:PORT/DB", help="share sessions, load and route-time inserts with the "
      "other gateways through this Redis (default: local, nothing shared)")
    a("--state-timeout", type=float, help="longest wait on Redis, per command (default 0.05 s)")
    a("--state-prefix", help="Redis key prefix shared by the gateways of one fleet (default kvroute)")
    a("--state-load-interval", type=float, help="seconds between load exchanges (default 0.1)")
    a("--state-load-ttl", type=float, help="a gateway's load record expires after this (default 2 s)")
    a("--state-dir", metavar="DIR", help="snapshot the router here periodically and at shutdown; restore at start")
    a("--snapshot-interval", type=float, help="seconds between snapshots with --state-dir (default 30)")


def from_args(args: argparse.Namespace) -> GatewayConfig:
    """TOML (--config) first, then every flag that was given."""
    data: dict[str, Any] = _load_toml(args.config) if getattr(args, "config", None) else {}
    for name in _FIELDS:
        value = getattr(args, name, None) if name != "replicas" else getattr(args, "replica", None)
        if value is not None:
            data[name] = value
    return build(data)


def build(data: Mapping[str, Any]) -> GatewayConfig:
    """A GatewayConfig from a mapping of field values (TOML types)."""
    data = dict(data)
    replicas = data.get("replicas", ())
    if isinstance(replicas, (str, Mapping)):
        replicas = [replicas]
    data["replicas"] = tuple(ReplicaSpec.from_toml(r) for r in replicas)
    lora = data.get("lora_models", ())
    data["lora_models"] = tuple(lora.split(",") if isinstance(lora, str) else lora)
    if "policy_params" in data and not isinstance(data["policy_params"], Mapping):
        raise ValueError("policy_params must be a table")
    return GatewayConfig(**data)


def parse_argv(argv: Sequence[str]) -> GatewayConfig:
    """Config from a `kvroute serve` argument list (for tests and embedding)."""
    parser = argparse.ArgumentParser(prog="kvroute serve")
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))
