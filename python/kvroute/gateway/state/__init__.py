"""State several gateways share (`kvroute serve --state`): one interface (base.SharedState),
a local backend that shares nothing and a Redis backend (redis_store.RedisState, over
link.RedisLink, which keeps the gateway going on local state while Redis is slow or gone).
What is shared and how stale each item may be: redis_store's docstring and the README
("Running several gateways")."""

from __future__ import annotations

from .base import LocalState, SharedState, make_state

__all__ = ["LocalState", "SharedState", "make_state"]
