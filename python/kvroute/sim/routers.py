"""Router names the simulator and `kvroute simulate` accept.

Every policy of kvroute.config.POLICY_PARAMS is a router name (with `_` or `-`), plus
aliases for the explainer's three routers and the peers':

================  ==========================================================================
name              router
================  ==========================================================================
round-robin       policy round_robin, no session ids (the explainer's round-robin)
sticky            policy sticky: the session id hashed on a ring (the explainer's sticky
                  sessions; alias sticky-sessions)
cache-aware       policy linear: longest match against queued prefill tokens with its
                  bounded escape to the least loaded replica (the seed's rule)
sglang, dynamo,   the peers' rules as kvroute policies (docs/peers.md); llm-d = llmd
llm-d, preble
ttft              kvroute's own policy: the lowest estimated time to first token
================  ==========================================================================

Only sticky routing is given the session ids by default: the peers' cache-aware routers
route each request on its prefix alone, and a session binding would turn any policy into
sticky routing with an escape. A `+session` suffix (e.g. `ttft+session`) passes them to any
policy, `+nosession` withholds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import POLICY_PARAMS, RouterConfig

ALIASES: dict[str, str] = {
    "round-robin": "round_robin",
    "rr": "round_robin",
    "sticky-sessions": "sticky",
    "session": "sticky",
    "cache-aware": "linear",
    "least-loaded": "least_loaded",
    "power-of-two": "power_of_two",
    "llm-d": "llmd",
}

#: The routers `kvroute simulate` compares by default: the explainer's three plus ttft.
DEFAULT_ROUTERS = ("round-robin", "sticky", "cache-aware", "ttft")

#: Every policy once, under its most familiar name (what scripts/results.py compares).
ALL_ROUTERS = ("round-robin", "random", "least-loaded", "power-of-two", "sticky", "cache-aware",
               "sglang", "dynamo", "llm-d", "preble", "ttft")


@dataclass(frozen=True)
class RouterSpec:
    """A named router: its policy, policy parameters and whether it sees session ids."""

    name: str
    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    sessions: bool = False

    def config(self, **overrides: Any) -> RouterConfig:
        """The RouterConfig for this router (overrides: other RouterConfig fields)."""
        return RouterConfig(policy=self.policy, params=dict(self.params), **overrides)


def router_spec(name: str, params: dict[str, Any] | None = None) -> RouterSpec:
    """Parse a router name (see the module docstring); ValueError names unknown ones."""
    if not isinstance(name, str):
        raise TypeError(f"router name must be a str, got {type(name).__name__}")
    base, _, suffix = name.strip().partition("+")
    key = base.strip().lower()
    policy = ALIASES.get(key, key.replace("-", "_"))
    if policy not in POLICY_PARAMS:
        known = ", ".join(sorted(set(ALIASES) | {p.replace("_", "-") for p in POLICY_PARAMS}))
        raise ValueError(f"unknown router {name!r}; expected one of {known}")
    if suffix not in ("", "session", "nosession"):
        raise ValueError(f"unknown router option +{suffix} in {name!r}; expected +session or +nosession")
    sessions = policy == "sticky" if suffix == "" else suffix == "session"
    spec = RouterSpec(name.strip(), policy, dict(params or {}), sessions)
    spec.config()  # validates the parameters now, with RouterConfig's messages
    return spec


__all__ = ["ALIASES", "ALL_ROUTERS", "DEFAULT_ROUTERS", "RouterSpec", "router_spec"]
