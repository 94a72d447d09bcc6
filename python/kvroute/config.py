"""RouterConfig: the validated settings of a Router, shared by both implementations.

The native Router and the reference Router read the same RouterConfig, so validation
(and its error messages) lives here once. `params` is completed with the policy's
defaults at construction, so `config.params` always lists every parameter in effect.

`params` is read-only (a dict whose every change is a TypeError, in both
implementations), and every Router runs with `validated(config)`: a plain RouterConfig
rebuilt from the given one's fields, so a subclass that skipped the checks is checked.

Policies and their parameters (defaults in parentheses). Every policy sees the same
per-replica vectors: matched blocks (from the prefix index, rounded down to whole engine
blocks per replica) and load (from the router's own lifecycle accounting plus
`report_load`). Ties go to the least recently chosen replica (never chosen: the lowest
id first): candidates are ordered by when each was last chosen, so equal replicas take
turns whatever the pattern of ties (a rotation offset that advanced on every decision
sent every first turn of 8-turn conversations to one replica of 8, sglang #32983).

Cache-aware policies (linear, sglang, dynamo, llmd, preble, ttft) also take
`min_match_tokens` (MIN_MATCH_TOKENS = 64): a replica whose match covers fewer prompt
tokens scores as if it matched nothing (Decision.matched_blocks and the load accounting
still report the real match). Unrelated prompts that share only a chat template (the
32-token case of sglang #32983) then spread as unrelated prompts do instead of piling
onto the replica that saw the template first. The default is from `kvroute simulate`
(chat workload, 8 replicas, precise knowledge, engine-model fleet; hit rate / mean TTFT /
p90 TTFT): ttft 64 -> 35.7% / 1.90 s / 4.93 s, 256 -> 34.7% / 1.94 s / 5.70 s; linear
0 -> 32.1% / 1.91 s, 64 -> 33.5% / 1.86 s, 256 -> 32.4% / 2.01 s. 64 (four blocks of 16)
is the best of these for both and still ignores a 32-token template; larger thresholds
also ignore real reuse of short histories. 0 restores matching on any block.

=============  =====================================================================
policy         rule and parameters
=============  =====================================================================
round_robin    the least recently chosen eligible replica. No parameters.
random         uniform among eligible replicas, from the seeded generator.
least_loaded   fewest in-flight requests.
power_of_two   two distinct replicas drawn from the seeded generator; the one with
               fewer in-flight requests (the first drawn on a tie).
sticky         consistent hashing of the session (else the prompt's first block) on a
               ring with `vnodes` (64) virtual nodes per replica. `bound` (None): with
               a float c >= 1, Mirrokni-Thorup-Zadimoghaddam bounded loads: capacity
               ceil(c * (in_flight_total + 1) / eligible); a replica at capacity is
               skipped and the walk continues along the ring.
linear         score = w_affinity (1.0) * matched_tokens - w_load (1.0) * queued
               prefill tokens, argmax; a match shorter than min_match_tokens (64)
               counts as 0. Escape: if the best-affinity replica's queued prefill
               tokens exceed escape_factor (1.5) times the eligible mean, the least
               loaded (queued prefill tokens) replica is chosen instead.
sglang         imbalanced := max_load - min_load > balance_abs_threshold (64) and
               max_load > min_load * balance_rel_threshold (1.5), load = in-flight
               requests: then least loaded. Else if matched/prompt tokens >
               cache_threshold (0.3): the longest match; else least loaded.
dynamo         cost = prefill_load_scale (1.0) * max(prefill_blocks + prompt_blocks -
               matched_blocks, 0) + decode_blocks + prompt_blocks; argmin, or with
               temperature (0.0) > 0 a softmax sample of -normalized cost / T.
llmd           w_prefix (3.0) * matched/prompt blocks + w_queue (2.0) * (max_q - q) /
               (max_q - min_q) (1 when all equal) + w_kv (2.0) * (1 - kv_usage);
               q = reported waiting, else the router's count of requests before their
               first token; kv_usage = reported, else 0. Argmax.
preble         cost = queued prefill tokens + uncached tokens + decode_weight (32.0) *
               in-flight requests. Exploit (matched tokens > new tokens on the
               longest-match replica): the cheapest replica among the longest-match
               holders; else explore: the cheapest replica overall.
ttft           lowest estimated time to first token on an engine that batches like vLLM
               (kvroute.sim.engine), in token-equivalents at the prefill rate:
               cost = W + steps * (D + step_tokens (120.0) + kv_weight (0.001) * KV)
               + fleet_weight (8.0) * (uncached - least uncached), where W = queued
               prefill tokens + this request's uncached tokens (the prefill ahead of
               and including it), D = requests past their first token (decodes, one
               token each per step), KV = their prompt tokens (decode_blocks x
               block_size: the KV each step reads), steps = ceil(W / max(batch_tokens
               (8192) - D, 1)) (at least 1: the engine steps it waits through, each
               costing a fixed step_tokens (12 ms x 10,000 tokens/s), its decodes'
               tokens and their KV reads (0.1 us per KV token x 10,000)); the last term
               is the prefill it adds to the fleet beyond the best-cached replica
               (work later requests wait behind: near the SLO several arrivals
               queue behind it, and near saturation a miss's prefill is capacity
               lost to every later request, hence a weight well above 1). Ties to
               the longer match, then fewer in-flight requests. With step_tokens =
               kv_weight = 0 and fleet_weight = 1 it is the FIFO estimate queued + 2
               x uncached - least uncached (+ steps x D). Pending cache: a
               replica's match also counts the leading blocks this prompt
               shares with requests routed to it that have not reported their first
               token (a request admitted in a later step than its twin finds the
               twin's blocks cached), so ttft is not blind between routing and the
               engine's KV events; those entries go at prefill_done, finish or
               remove_replica, and cost O(prompt blocks) per queued request on a
               replica per decision. Decision.matched_blocks and the queued tokens
               include them. Tuned on kvroute simulate's engine model: the decode
               terms lower chat's p90 TTFT at x0.6 from 2.75 s to 2.54 s. fleet_weight
               8 (was 1), goodput factor (kvroute.sim.sweep, 1% resolution, seed 0)
               with fleet_weight 1 / 3 / 8: shared-prefix x8.13 / x10.83 / x10.83
               (seeds 1-3 with 8: x12.75, x11.38, x13.17; sticky x7.79, x7.26, x8.92);
               chat, 8 replicas, SLO 4 s: x0.942 / x0.968 / x0.922 (best peer llm-d
               x0.841); chat, 16 replicas: - / x1.039 / x1.05 (preble x0.893); the
               conversation trace, SLO 4 s: - / x1.628 / x1.646 (preble x1.628, a tie
               that 8 breaks by keeping more hits near saturation). docs/results.md.
=============  =====================================================================

Decision.reason: "session" (kept binding), "affinity" (the chosen replica has the
longest match, which is > 0), "load" (a longer match existed elsewhere but load won),
"miss" (no replica matched), "balance" (a policy that ignores the cache), "hash"
(sticky: the ring position), "overflow" (sticky: walked past full replicas).

Sessions: a bound session stays on its replica unless that replica is removed, drained,
unhealthy or saturated. Saturated means: sglang, the imbalance rule with the replica
as max; linear, the escape rule; sticky, at its bound capacity (never without a bound);
every other policy, in-flight requests > max(1, session_saturation * eligible mean).

Bounds (each counted in Router.stats()): the session table holds at most max_sessions
ids and at most max_session_bytes (16 MiB) of their UTF-8 bytes, least recently used
evicted first (session_evictions; a single longer id is a ValueError); a request routed
and never finished is released request_ttl (3600 s) after it was routed, at the next
route() (request_expirations; its handle then reads as finished); num_tokens is below
2**32 so no load sum can overflow.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from .reference.hashing import MAX_BLOCK_SIZE, salt_bytes

#: Default of every cache-aware policy's min_match_tokens (see the module docstring).
MIN_MATCH_TOKENS = 64

#: policy -> {parameter: default}. A parameter with default None is optional.
POLICY_PARAMS: dict[str, dict[str, Any]] = {
    "round_robin": {},
    "random": {},
    "least_loaded": {},
    "power_of_two": {},
    "sticky": {"vnodes": 64, "bound": None},
    "linear": {"w_affinity": 1.0, "w_load": 1.0, "min_match_tokens": MIN_MATCH_TOKENS, "escape_factor": 1.5},
    "sglang": {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "min_match_tokens": MIN_MATCH_TOKENS,
    },
    "dynamo": {"prefill_load_scale": 1.0, "temperature": 0.0, "min_match_tokens": MIN_MATCH_TOKENS},
    "llmd": {"w_prefix": 3.0, "w_queue": 2.0, "w_kv": 2.0, "min_match_tokens": MIN_MATCH_TOKENS},
    "preble": {"decode_weight": 32.0, "min_match_tokens": MIN_MATCH_TOKENS},
    "ttft": {"step_tokens": 120.0, "kv_weight": 0.001, "batch_tokens": 8192, "fleet_weight": 8.0,
             "min_match_tokens": MIN_MATCH_TOKENS},
}

#: Integer parameters (the rest are floats).
_INT_PARAMS = {"vnodes", "min_match_tokens", "balance_abs_threshold", "batch_tokens"}

MODES = ("approximate", "precise", "hybrid")
MAX_VNODES = 4096
#: Upper limit of max_session_bytes (1 TiB): far above any memory, far below int64.
MAX_SESSION_BYTES = 1 << 40
#: Largest engine_block_size add_replica() accepts (tokens).
MAX_ENGINE_BLOCK_SIZE = 1 << 20


class FrozenParams(dict):  # type: ignore[type-arg]
    """RouterConfig.params: a dict that refuses every change (TypeError), so a Router never
    sees parameters other than those validated at construction."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("RouterConfig.params is read-only; build a new RouterConfig to change it")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenParams, (dict(self),))

    def __copy__(self) -> FrozenParams:
        return self

    def __deepcopy__(self, memo: Any) -> FrozenParams:
        return self


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and (isinstance(value, (int, float)) or _is_int(value))


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {'in ' if high is not None else ''}{bound}, got {value}")
    return value


def _float(name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def _check_param(policy: str, name: str, value: Any) -> Any:
    key = f"params[{name!r}] of policy {policy!r}"
    if name == "bound":
        if value is None:
            return None
        return _float(key, value, low=1.0)
    if name == "vnodes":
        return _int(key, value, 1, MAX_VNODES)
    if name in _INT_PARAMS:
        return _int(key, value, 0)
    if name in ("balance_rel_threshold", "escape_factor"):
        return _float(key, value, low=1.0)
    if name == "cache_threshold":
        checked = _float(key, value)
        if checked > 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {checked!r}")
        return checked
    return _float(key, value)


@dataclass(frozen=True)
class RouterConfig:
    """Validated Router settings; see the module docstring for the policy table.

    policy: one of POLICY_PARAMS. params: policy parameters (missing ones take their
    defaults; unknown ones are a ValueError). block_size, salt: how route() hashes
    tokens (must match the engines'). mode: "approximate" (the router inserts each
    routed prompt into its index), "precise" (only engine events feed the index) or
    "hybrid" (routed prompts go to a second, speculative index that forgets them after
    speculative_ttl seconds; matches are the elementwise max of both). index_capacity
    (blocks per replica) and index_ttl (seconds) bound the router's index.
    session_ttl (sliding, seconds) and max_sessions (LRU beyond it) bound the session
    table, max_session_bytes bounds the bytes of its ids. request_ttl (seconds): a
    request routed and never finished is released after it. seed drives every random
    choice. prefill_rate (tokens per second) converts queued tokens into time for the
    ttft policy. session_saturation: see the module doc.
    """

    policy: str = "ttft"
    params: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    salt: str | bytes | None = None
    mode: str = "approximate"
    index_capacity: int | None = None
    index_ttl: float | None = None
    speculative_ttl: float = 2.0
    session_ttl: float = 600.0
    max_sessions: int = 100_000
    max_session_bytes: int = 16 << 20
    request_ttl: float = 3600.0
    seed: int = 0
    prefill_rate: float = 10_000.0
    session_saturation: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise TypeError(f"policy must be a str, got {type(self.policy).__name__}")
        if self.policy not in POLICY_PARAMS:
            raise ValueError(
                f"unknown policy {self.policy!r}; expected one of {', '.join(POLICY_PARAMS)}"
            )
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a dict, got {type(self.params).__name__}")
        defaults = POLICY_PARAMS[self.policy]
        resolved = dict(defaults)
        for name, value in self.params.items():
            if name not in defaults:
                known = ", ".join(defaults) or "none"
                raise ValueError(
                    f"unknown parameter {name!r} for policy {self.policy!r} (known: {known})"
                )
            resolved[name] = _check_param(self.policy, name, value)
        for name, value in resolved.items():
            if value is not None and name not in _INT_PARAMS and name != "bound":
                resolved[name] = float(value)
        object.__setattr__(self, "params", FrozenParams(resolved))
        object.__setattr__(self, "block_size", _int("block_size", self.block_size, 1, MAX_BLOCK_SIZE))
        salt_bytes(self.salt)  # TypeError for anything but str, bytes-like or None
        if isinstance(self.salt, (bytearray, memoryview)):
            object.__setattr__(self, "salt", bytes(self.salt))
        if not isinstance(self.mode, str):
            raise TypeError(f"mode must be a str, got {type(self.mode).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.index_capacity is not None:
            object.__setattr__(self, "index_capacity", _int("index_capacity", self.index_capacity, 1))
        if self.index_ttl is not None:
            object.__setattr__(self, "index_ttl", _float("index_ttl", self.index_ttl, strict=True))
        object.__setattr__(self, "speculative_ttl", _float("speculative_ttl", self.speculative_ttl, strict=True))
        object.__setattr__(self, "session_ttl", _float("session_ttl", self.session_ttl, strict=True))
        object.__setattr__(self, "max_sessions", _int("max_sessions", self.max_sessions, 1))
        object.__setattr__(
            self, "max_session_bytes", _int("max_session_bytes", self.max_session_bytes, 1, MAX_SESSION_BYTES)
        )
        object.__setattr__(self, "request_ttl", _float("request_ttl", self.request_ttl, strict=True))
        object.__setattr__(self, "seed", _int("seed", self.seed, 0, (1 << 64) - 1))
        object.__setattr__(self, "prefill_rate", _float("prefill_rate", self.prefill_rate, strict=True))
        object.__setattr__(
            self, "session_saturation", _float("session_saturation", self.session_saturation, low=1.0)
        )

    def salt_bytes(self) -> bytes:
        """The salt as the bytes the hash chain's root is taken over."""
        return salt_bytes(self.salt)


def validated(config: Any) -> RouterConfig:
    """The RouterConfig a Router runs with: None -> the defaults; a RouterConfig (or any
    subclass, also one whose __post_init__ skipped the checks) -> a plain RouterConfig
    rebuilt from its fields, so RouterConfig's own checks hold whatever object was handed
    in. Both Router implementations call this; TypeError for anything else."""
    if config is None:
        return RouterConfig()
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a RouterConfig or None, got {type(config).__name__}")
    return RouterConfig(**{f.name: getattr(config, f.name) for f in fields(RouterConfig)})
