"""Router, reference twin of cpp/src/router.cpp: affinity versus load, sessions, lifecycle.

API (the contract the simulator and gateways code against):

    Router(config: RouterConfig | None = None, replicas: Iterable[str] = ())
    .add_replica(name, *, engine_block_size=None) -> int; .remove_replica(name)
    .drain(name, draining=True); .set_healthy(name, healthy); .replicas -> list[str]
    .replica_id(name) -> int; .engine_block(name) -> int
    .route(tokens, *, session=None, now=None) -> Decision
    .route_hashes(hashes, num_tokens, *, session=None, now=None) -> Decision
    .prefill_done(handle, now=None); .finish(handle, now=None)
    .report_load(name, *, waiting=None, running=None, kv_usage=None); .load(name) -> dict
    .set_external_load(name, *, in_flight=0, queued_prefill_tokens=0, prefill_requests=0,
                       prefill_blocks=0, decode_blocks=0)
    .bind_session(session, name, *, now=None); .session(session, *, now=None) -> str | None
    .observe_route(name, hashes, *, now=None) -> int
    .index -> PrefixIndex; .speculative_index -> PrefixIndex | None (hybrid); .stats() -> dict

The config is kvroute.config.validated(config): RouterConfig's checks hold whatever object
is handed in. The policy is one class of kvroute.reference.policies over a View of the
decision's inputs; this module does everything around it.

Decisions, in order: validate every argument; if no replica is live, healthy and not
draining, RuntimeError. Time-driven housekeeping: expire the index(es) when they have a
TTL, and release the requests routed request_ttl or more seconds ago that never finished
(oldest first, stopping at the first younger one; counted in request_expirations). Match
the prompt's block hashes against the index (hybrid: elementwise max with the
speculative index), let the policy raise them (ttft: the longest common leading-block run
with any request on the replica before its first token, the pending cache), and round
each replica's match down to whole engine blocks (add_replica's engine_block_size): that
is Decision.matched_blocks. The policy scores a match shorter than min_match_tokens
(cache-aware policies) as none. A session bound to a replica that is still eligible and
not saturated keeps it; otherwise the policy chooses, over the eligible replicas (without
the saturated bound one if any other is eligible) ordered least recently chosen first:
every tie goes to the replica chosen longest ago (never chosen: by id). In approximate
mode the prompt is then inserted under the chosen replica (hybrid: into the speculative
index); only after that insert succeeded does anything else change: the chosen replica
becomes the most recently chosen, the random generator advances, the request is
reserved on the replica (route-and-reserve), the session table is updated (sliding TTL,
LRU beyond max_sessions or max_session_bytes of ids).

Lifecycle: route() returns a Decision with a handle (1, 2, ...). prefill_done(handle) at
the first token moves the request from prefill to decode; finish(handle) releases it.
A handle never issued is an IndexError; one already finished or expired, or prefill_done
twice, a RuntimeError. remove_replica() releases the accounting of the requests in flight
on it; their handles stay valid until finished, and prefill_done/finish on them are no-ops.

Bounds: num_tokens < 2**32 (so no load sum overflows; prompt_tokens and cached_tokens
counters saturate at 2**63 - 1); requests in flight expire after request_ttl; the session
table holds at most max_sessions ids of at most max_session_bytes UTF-8 bytes in all (a
longer single id is a ValueError).

Several routers, one fleet (gateways running active-active): each router accounts only the
requests it routed itself ("own" load); set_external_load(name, ...) replaces the load the
OTHER routers put on a replica (in_flight, queued_prefill_tokens, prefill_requests,
prefill_blocks, decode_blocks: ints in [0, 2**40], KeyError for an unknown replica,
TypeError for a non-int or bool, ValueError naming the field when out of range; on any
error nothing changes). Every load term any policy or the session saturation rule reads is
own + external, and load(name) reports those sums under its usual keys, with the two parts
under "own" (what a router publishes to the others) and "external". Removing a replica
drops its external load with the rest of its accounting. External load is a figure, not
requests: prefill_done/finish never touch it, and ttft's pending cache holds only the
router's own requests. bind_session(session, name) binds a session as if this router had
routed it to `name` (another router did): sliding TTL from `now`, the session table's
bounds apply, its block count is kept when it stays on the same replica and is 0
otherwise; no decision is counted. session(session) reads the binding without refreshing
it: the replica's name, or None when unbound, expired or the replica was removed since.
observe_route(name, hashes) applies another router's route-time insert: in approximate
mode the chain goes into the index under `name`, in hybrid into the speculative index
(speculative_ttl), after the same index TTL housekeeping a route does; it returns the
blocks newly held, raises what route's insert raises (a chain that contradicts the index:
nothing changes) and reserves no load, touches no session, tie order or generator. In
precise mode the index follows the engines' events, which every router subscribes to, so
there is nothing to share: observe_route validates its arguments and returns 0.

Stranded blocks: a rebound session reports the block count of its last prompt on its
previous replica (the KV work it leaves behind), even when that replica was removed.

Randomness (random, power_of_two, dynamo with temperature) comes from a splitmix64
generator seeded with config.seed, identical in both implementations, so the same calls
give the same decisions. Replica names and sessions are placed on the sticky ring by
FNV-1a-64 of their UTF-8 bytes, mixed by the splitmix64 finalizer.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .args import check_text
from .hashing import block_hashes, tokens_as_uint32
from .index import MAX_ENGINE_BLOCK, PrefixIndex, _now, as_hashes
from .policies import Policy, SplitMix64, View, fnv1a64, make_policy, mix64

__all__ = ["Decision", "Router", "SplitMix64", "fnv1a64", "mix64"]

_I64_MAX = (1 << 63) - 1
#: Largest num_tokens a request may claim (2**32 - 1): keeps load sums far from overflow.
MAX_PROMPT_TOKENS = (1 << 32) - 1
#: Largest engine_block_size add_replica() accepts (tokens).
MAX_ENGINE_BLOCK_SIZE = 1 << 20
#: Largest value of each set_external_load() term (2**40): sums stay far from overflow.
MAX_EXTERNAL_LOAD = 1 << 40
#: The load terms set_external_load() takes, in its keyword order (and load()'s "own"/"external").
LOAD_TERMS = ("in_flight", "queued_prefill_tokens", "prefill_requests", "prefill_blocks", "decode_blocks")
_NO_LOAD = (0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why; `handle` is for prefill_done() and finish().

    replica/replica_id: the chosen replica. matched_blocks: leading blocks of the prompt
    it holds (ttft: or will hold once the requests queued there before it prefill),
    rounded down to whole engine blocks of that replica;
    cached_tokens: min(matched_blocks * block_size, prompt_tokens).
    reason: "session", "affinity", "load", "miss", "balance", "hash" or "overflow" (see
    kvroute.config). binding: "none" (no session), "new", "kept" or "rebound".
    stranded_blocks: on a rebind, the session's blocks left on its previous replica.
    """

    replica: str
    replica_id: int
    matched_blocks: int
    cached_tokens: int
    prompt_tokens: int
    reason: str
    binding: str
    stranded_blocks: int
    handle: int

    def __repr__(self) -> str:
        return (
            f"Decision(replica='{self.replica}', replica_id={self.replica_id}, "
            f"matched_blocks={self.matched_blocks}, cached_tokens={self.cached_tokens}, "
            f"prompt_tokens={self.prompt_tokens}, reason='{self.reason}', "
            f"binding='{self.binding}', stranded_blocks={self.stranded_blocks}, "
            f"handle={self.handle})"
        )


class _Request:
    __slots__ = ("replica", "uncached", "blocks", "uncached_blocks", "routed_at", "prefilled")

    def __init__(self, replica: int, uncached: int, blocks: int, uncached_blocks: int, routed_at: float) -> None:
        self.replica = replica  # -1 once its replica was removed
        self.uncached = uncached
        self.blocks = blocks
        self.uncached_blocks = uncached_blocks
        self.routed_at = routed_at
        self.prefilled = False


class _Session:
    __slots__ = ("replica", "gen", "blocks", "last_seen")

    def __init__(self, replica: int, gen: int, blocks: int, last_seen: float) -> None:
        self.replica = replica
        self.gen = gen
        self.blocks = blocks
        self.last_seen = last_seen


@dataclass
class _Picked:
    """Where the session step left a decision."""

    chosen: int
    reason: str
    binding: str
    stranded: int
    expired_entry: bool


def _text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return check_text(value, what)


def _name(name: Any) -> str:
    return _text("replica name", name)


def _flag(what: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__}")
    return bool(value)


def _int(what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def _count(what: str, value: Any) -> int:
    v = _int(what, value)
    if not 0 <= v < (1 << 63):
        raise ValueError(f"{what} must be in [0, 2**63), got {v}")
    return v


def _num_tokens(value: Any) -> int:
    v = _int("num_tokens", value)
    if not 0 <= v <= MAX_PROMPT_TOKENS:
        raise ValueError(f"num_tokens must be in [0, 2**32), got {v}")
    return v


def _external(what: str, value: Any) -> int:
    v = _int(what, value)
    if not 0 <= v <= MAX_EXTERNAL_LOAD:
        raise ValueError(f"{what} must be in [0, 2**40], got {v}")
    return v


def _session_id(session: Any, limit: int) -> str:
    if not isinstance(session, str):
        raise TypeError(f"session must be a str, got {type(session).__name__}")
    size = len(_text("session", session).encode("utf-8"))
    if size > limit:
        raise ValueError(f"session must be at most {limit} bytes (max_session_bytes), got {size}")
    return session


def _engine_block_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"engine_block_size must be an int or None, got {type(value).__name__}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"engine_block_size must be an int or None, got {type(value).__name__}") from None
    if not 1 <= v <= MAX_ENGINE_BLOCK_SIZE:
        raise ValueError(f"engine_block_size must be in [1, {MAX_ENGINE_BLOCK_SIZE}], got {v}")
    return v


def _is_live(index: PrefixIndex, r: int) -> bool:
    return r < index.num_replicas and r not in index._retired


class Router:
    """Chooses a replica per request by KV-cache affinity versus load; see the module doc."""

    def __init__(self, config: Any = None, replicas: Iterable[str] = ()) -> None:
        from ..config import validated

        cfg = validated(config)
        self._cfg = cfg
        self._p = dict(cfg.params)
        self._bs = cfg.block_size
        self._salt = cfg.salt_bytes()
        self._min_match: int = self._p.get("min_match_tokens", 0)
        self._policy: Policy = make_policy(cfg.policy, self._p, cfg.session_saturation)
        self._lock = threading.RLock()
        self._index = PrefixIndex(0, capacity=cfg.index_capacity, ttl=cfg.index_ttl)
        self._spec = (
            PrefixIndex(0, capacity=cfg.index_capacity, ttl=cfg.speculative_ttl) if cfg.mode == "hybrid" else None
        )
        self._names: list[str | None] = []
        self._ids: dict[str, int] = {}
        self._gen: list[int] = []
        self._healthy: list[bool] = []
        self._draining: list[bool] = []
        self._queued: list[int] = []
        self._inflight: list[int] = []
        self._prefill_reqs: list[int] = []
        self._prefill_blocks: list[int] = []
        self._decode_blocks: list[int] = []
        self._waiting: list[int | None] = []
        self._running: list[int | None] = []
        self._kv: list[float | None] = []
        # The five load lists above hold own + external (what policies read); _ext holds the
        # external part, as set_external_load() last set it (LOAD_TERMS order).
        self._ext: list[tuple[int, ...]] = []
        self._chosen_once: list[bool] = []
        self._recency: list[int] = []  # live replicas, least recently chosen first
        self._requests: dict[int, _Request] = {}  # insertion (= handle = routing) order
        self._next_handle = 1
        self._rng = SplitMix64(cfg.seed)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._session_bytes = 0
        self._stats = {
            "routed": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "rebinds": 0,
            "stranded_blocks": 0,
            "session_expirations": 0,
            "session_evictions": 0,
            "request_expirations": 0,
        }
        if isinstance(replicas, (str, bytes)):
            raise TypeError("replicas must be an iterable of names, got a single str")
        for name in replicas:
            self.add_replica(name)

    # -- replicas ---------------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The RouterConfig this router runs with (kvroute.config.validated of the one given)."""
        return self._cfg

    @property
    def index(self) -> PrefixIndex:
        """The prefix index routing reads (and, in approximate mode, writes); events feed it."""
        return self._index

    @property
    def speculative_index(self) -> PrefixIndex | None:
        """Hybrid mode's short-TTL index of route-time insertions, else None."""
        return self._spec

    @property
    def replicas(self) -> list[str]:
        """Names of the replicas, in id order (removed ones left out)."""
        with self._lock:
            return [n for n in self._names if n is not None]

    def replica_id(self, name: str) -> int:
        """The dense id of a replica (its id in router.index)."""
        with self._lock:
            return self._lookup(name)

    def engine_block(self, name: str) -> int:
        """Router blocks per engine block of a replica, as the index holds it (set by
        add_replica or learned from events; 1: every router block is whole)."""
        with self._lock:
            return self._index.engine_block(self._lookup(name))

    def add_replica(self, name: str, *, engine_block_size: int | None = None) -> int:
        """Add a replica (healthy, not draining); returns its id (the lowest free one).
        engine_block_size: tokens per engine KV block (a multiple of block_size, or at most
        it; None: block_size): matches on it are rounded down to whole engine blocks."""
        with self._lock:
            _name(name)
            size = _engine_block_size(engine_block_size)
            if not name:
                raise ValueError("replica name must not be empty")
            if name in self._ids:
                raise ValueError(f"replica '{name}' already exists")
            k = self._engine_k(size)
            r = self._index.add_replica()
            self._align_spec(r)
            while r >= len(self._names):  # ids added to router.index directly stay dead slots
                for arr, v in self._arrays():
                    arr.append(v)
                self._gen.append(0)
            for arr, v in self._arrays():
                arr[r] = v
            self._names[r] = name
            self._gen[r] += 1
            if k > 1:
                self._index.set_engine_block(r, k)
            self._ids[name] = r
            # Never chosen: ahead of every replica that was, after never-chosen lower ids.
            pos = next(
                (i for i, q in enumerate(self._recency) if self._chosen_once[q] or q > r), len(self._recency)
            )
            self._recency.insert(pos, r)
            self._policy.replica_added(r, name)
            return r

    def remove_replica(self, name: str) -> None:
        """Remove a replica: its index blocks go, its in-flight requests are released."""
        with self._lock:
            r = self._lookup(name)
            self._index.remove_replica(r)
            if self._spec is not None:
                self._spec.remove_replica(r)
            for req in self._requests.values():
                if req.replica == r:
                    req.replica = -1
            self._policy.replica_removed(r, name)
            for arr, v in self._arrays():
                arr[r] = v
            self._names[r] = None
            del self._ids[name]
            self._recency.remove(r)

    def drain(self, name: str, draining: bool = True) -> None:
        """Stop (or resume) sending new requests to a replica; its state is kept."""
        with self._lock:
            r = self._lookup(name)
            self._draining[r] = _flag("draining", draining)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Mark a replica healthy or not; an unhealthy replica is never chosen."""
        with self._lock:
            r = self._lookup(name)
            self._healthy[r] = _flag("healthy", healthy)

    def report_load(
        self,
        name: str,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Set engine-reported load figures (those given; None leaves a figure as it is)."""
        with self._lock:
            r = self._lookup(name)
            w = None if waiting is None else _count("waiting", waiting)
            n = None if running is None else _count("running", running)
            k = None
            if kv_usage is not None:
                if isinstance(kv_usage, (bool, np.bool_)) or not isinstance(
                    kv_usage, (int, float, np.integer, np.floating)
                ):
                    raise TypeError(f"kv_usage must be a float, got {type(kv_usage).__name__}")
                k = float(kv_usage)
                if not 0.0 <= k <= 1.0:
                    raise ValueError(f"kv_usage must be in [0, 1], got {k!r}")
            if w is not None:
                self._waiting[r] = w
            if n is not None:
                self._running[r] = n
            if k is not None:
                self._kv[r] = k

    def load(self, name: str) -> dict[str, Any]:
        """A replica's load terms (own + external), reported figures and flags; "own": the
        requests this router routed there, "external": what set_external_load() set."""
        with self._lock:
            r = self._lookup(name)
            ext = self._ext[r]
            totals = [arr[r] for arr in self._load_lists()]
            return {
                "queued_prefill_tokens": self._queued[r],
                "in_flight": self._inflight[r],
                "prefill_requests": self._prefill_reqs[r],
                "active_blocks": self._prefill_blocks[r] + self._decode_blocks[r],
                "prefill_blocks": self._prefill_blocks[r],
                "decode_blocks": self._decode_blocks[r],
                "waiting": self._waiting[r],
                "running": self._running[r],
                "kv_usage": self._kv[r],
                "healthy": self._healthy[r],
                "draining": self._draining[r],
                "own": {k: t - e for k, t, e in zip(LOAD_TERMS, totals, ext)},
                "external": dict(zip(LOAD_TERMS, ext)),
            }

    def set_external_load(
        self,
        name: str,
        *,
        in_flight: int = 0,
        queued_prefill_tokens: int = 0,
        prefill_requests: int = 0,
        prefill_blocks: int = 0,
        decode_blocks: int = 0,
    ) -> None:
        """Replace the load other routers put on a replica (each term an int in [0, 2**40]);
        every policy then sees own + external."""
        with self._lock:
            r = self._lookup(name)
            given = (in_flight, queued_prefill_tokens, prefill_requests, prefill_blocks, decode_blocks)
            new = tuple(_external(k, v) for k, v in zip(LOAD_TERMS, given))
            for arr, n, o in zip(self._load_lists(), new, self._ext[r]):
                arr[r] += n - o
            self._ext[r] = new

    def bind_session(self, session: str, name: str, *, now: float | None = None) -> None:
        """Bind (or rebind) a session to a replica as if this router had routed it there:
        sliding TTL from now, within the session table's bounds."""
        key = _session_id(session, self._cfg.max_session_bytes)
        with self._lock:
            r = self._lookup(name)
            t = time.monotonic() if now is None else _now(now)
            entry = self._sessions.get(key)
            expired = entry is not None and entry.last_seen + self._cfg.session_ttl <= t
            same = entry is not None and not expired and entry.replica == r and entry.gen == self._gen[r]
            blocks = entry.blocks if same and entry is not None else 0
            self._update_session(key, _Picked(r, "", "", 0, expired), r, blocks, t)

    def session(self, session: str, *, now: float | None = None) -> str | None:
        """The replica a session is bound to, or None (unbound, expired, replica removed);
        the TTL is not refreshed."""
        key = _session_id(session, self._cfg.max_session_bytes)
        with self._lock:
            t = time.monotonic() if now is None else _now(now)
            entry = self._sessions.get(key)
            if entry is None or entry.last_seen + self._cfg.session_ttl <= t:
                return None
            if self._names[entry.replica] is None or self._gen[entry.replica] != entry.gen:
                return None
            return self._names[entry.replica]

    def observe_route(self, name: str, hashes: Any, *, now: float | None = None) -> int:
        """Another router routed a prompt with these block hashes to `name`: insert them as
        this router's own route would (approximate: index, hybrid: speculative index;
        precise: nothing, 0). Returns blocks newly held; no load, session or tie change."""
        with self._lock:
            r = self._lookup(name)
            hs = as_hashes(hashes)
            t = time.monotonic() if now is None else _now(now)
            if self._cfg.mode == "precise":
                return 0
            self._expire_indexes(t)
            if self._spec is not None:
                return self._spec.insert(r, hs, t)
            return self._index.insert(r, hs, t)

    def stats(self) -> dict[str, Any]:
        """Counters: decisions, tokens, rebinds, sessions (and their id bytes), requests in
        flight and expired."""
        with self._lock:
            out = dict(self._stats)
            out["sessions"] = len(self._sessions)
            out["session_bytes"] = self._session_bytes
            out["in_flight"] = len(self._requests)
            out["replicas"] = len(self._ids)
            return out

    # -- routing ----------------------------------------------------------------------------

    def route(
        self,
        tokens: Any,
        *,
        session: str | None = None,
        now: float | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
        mm: Any = None,
    ) -> Decision:
        """Route a prompt of token ids, hashed with config.block_size and config.salt and the
        request's cache keys (lora, cache_salt, mm: as block_hashes takes them), so a prompt
        is matched only against KV stored under the same keys."""
        data = tokens_as_uint32(tokens)
        hashes = block_hashes(data, self._bs, salt=self._salt, lora=lora, cache_salt=cache_salt, mm=mm)
        return self._route(hashes, len(data), session, now)

    def route_hashes(
        self, hashes: Any, num_tokens: int, *, session: str | None = None, now: float | None = None
    ) -> Decision:
        """Route a prompt given as precomputed block hashes covering num_tokens tokens
        (at most 2**32 - 1)."""
        hs = as_hashes(hashes)
        n = _num_tokens(num_tokens)
        return self._route(hs, n, session, now)

    def prefill_done(self, handle: int, now: float | None = None) -> None:
        """The request produced its first token: its prompt moves from prefill to decode."""
        with self._lock:
            h = _int("handle", handle)
            _now(now)
            req = self._request(h)
            if req.replica < 0:
                return
            if req.prefilled:
                raise RuntimeError(f"request {h} already reported its first token")
            r = req.replica
            req.prefilled = True
            self._policy.released(h, r)
            self._queued[r] -= req.uncached
            self._prefill_reqs[r] -= 1
            self._prefill_blocks[r] -= req.uncached_blocks
            self._decode_blocks[r] += req.blocks

    def finish(self, handle: int, now: float | None = None) -> None:
        """The request ended (completed, failed or cancelled): release its load."""
        with self._lock:
            h = _int("handle", handle)
            _now(now)
            req = self._request(h)
            del self._requests[h]
            self._release(h, req)

    # -- internals --------------------------------------------------------------------------

    # -- snapshots (kvroute.reference.snapshot, docs/snapshot-format.md) ---------------------

    def snapshot(self, path: Any, *, applier: Any = None, cursors: Any = None, now: float | None = None) -> dict[str, Any]:
        """Write the index contents, engine blocks, sessions, `cursors` ({replica name:
        {"seq", "digest"}}, passed through) and, with an applier, its per-replica state to
        `path` atomically (contract C7). Returns {"replicas", "blocks", "sessions", "bytes"}.
        Hybrid's speculative index and requests in flight are not saved."""
        from . import snapshot

        return snapshot.snapshot(self, path, applier=applier, cursors=cursors, now=now)

    def restore(self, path: Any, *, applier: Any = None, now: float | None = None) -> dict[str, Any]:
        """Load a snapshot: replicas missing here are added; each restored replica's index
        contents, engine block, sessions (and applier state) replace this router's. The whole
        file is checked first: ValueError naming the problem, nothing changed. Returns
        {"replicas", "blocks", "sessions", "cursors", "age"} (age: seconds since written)."""
        from . import snapshot

        return snapshot.restore(self, path, applier=applier, now=now)

    def _export_sessions(self, t: float) -> list[tuple[str, int, int, float]]:
        """(id, replica id, blocks, age) of the sessions bound to a live replica and not
        expired at t, least recently used first."""
        ttl = self._cfg.session_ttl
        return [
            (key, s.replica, s.blocks, max(0.0, t - s.last_seen))
            for key, s in self._sessions.items()
            if self._names[s.replica] is not None and self._gen[s.replica] == s.gen and s.last_seen + ttl > t
        ]

    def _import_sessions(self, ids: list[int], records: list[tuple[str, int, int, float]], t: float) -> int:
        """Drops the sessions bound to `ids`, then binds each record (least recent first) as
        last used age seconds before t, unless expired or longer than max_session_bytes;
        evicts beyond the table's bounds."""
        sessions = self._sessions
        gone = set(ids)
        for key in [k for k, s in sessions.items() if s.replica in gone]:
            del sessions[key]
            self._session_bytes -= len(key.encode("utf-8"))
        n = 0
        for key, r, blocks, age in records:
            last = t - age
            # An id longer than this table takes in all would only push every other one out.
            if not last + self._cfg.session_ttl > t or len(key.encode("utf-8")) > self._cfg.max_session_bytes:
                continue
            old = sessions.pop(key, None)
            if old is not None:
                self._session_bytes -= len(key.encode("utf-8"))
            sessions[key] = _Session(r, self._gen[r], blocks, last)
            self._session_bytes += len(key.encode("utf-8"))
            n += 1
        while len(sessions) > self._cfg.max_sessions or self._session_bytes > self._cfg.max_session_bytes:
            self._drop_oldest_session("session_evictions")
        return n

    def _arrays(self) -> list[tuple[list[Any], Any]]:
        return [
            (self._names, None),
            (self._healthy, True),
            (self._draining, False),
            (self._queued, 0),
            (self._inflight, 0),
            (self._prefill_reqs, 0),
            (self._prefill_blocks, 0),
            (self._decode_blocks, 0),
            (self._waiting, None),
            (self._running, None),
            (self._kv, None),
            (self._ext, _NO_LOAD),
            (self._chosen_once, False),
        ]

    def _load_lists(self) -> list[list[int]]:
        """The load terms by replica, in LOAD_TERMS order (own + external)."""
        return [self._inflight, self._queued, self._prefill_reqs, self._prefill_blocks, self._decode_blocks]

    def _engine_k(self, size: int | None) -> int:
        if size is None or size <= self._bs:
            return 1  # a router block is whole engine blocks (contract C2: k = 1)
        if size % self._bs:
            raise ValueError(
                f"engine_block_size must be a multiple of block_size ({self._bs}) or at most it, got {size}"
            )
        if size // self._bs > MAX_ENGINE_BLOCK:
            raise ValueError(f"engine_block_size must be at most {MAX_ENGINE_BLOCK} router blocks, got {size // self._bs}")
        return size // self._bs

    def _align_spec(self, r: int) -> None:
        # The speculative index must use the main index's id for the same replica, also when
        # ids were taken in router.index directly: claim exactly r there, hand back the rest.
        spec = self._spec
        if spec is None:
            return
        if _is_live(spec, r):
            spec.remove_replica(r)
        others = []
        s = spec.add_replica()
        while s != r:
            others.append(s)
            s = spec.add_replica()
        for s in others:
            spec.remove_replica(s)

    def _lookup(self, name: Any) -> int:
        _name(name)
        r = self._ids.get(name)
        if r is None:
            raise KeyError(f"unknown replica '{name}'")
        return r

    def _request(self, h: int) -> _Request:
        req = self._requests.get(h)
        if req is None:
            if 1 <= h < self._next_handle:
                raise RuntimeError(f"request {h} already finished or expired")
            raise IndexError(f"unknown handle {h}")
        return req

    def _release(self, h: int, req: _Request) -> None:
        r = req.replica
        if r < 0:
            return
        if req.prefilled:
            self._decode_blocks[r] -= req.blocks
        else:
            self._policy.released(h, r)
            self._queued[r] -= req.uncached
            self._prefill_reqs[r] -= 1
            self._prefill_blocks[r] -= req.uncached_blocks
        self._inflight[r] -= 1

    def _eligible(self, r: int) -> bool:
        return self._names[r] is not None and self._healthy[r] and not self._draining[r]

    def _expire(self, t: float) -> None:
        """Time-driven housekeeping: index TTLs and requests never finished."""
        self._expire_indexes(t)
        ttl, requests = self._cfg.request_ttl, self._requests
        while requests:
            h, req = next(iter(requests.items()))
            if not req.routed_at + ttl <= t:
                break
            del requests[h]
            self._release(h, req)
            self._stats["request_expirations"] += 1

    def _expire_indexes(self, t: float) -> None:
        if self._cfg.index_ttl is not None:
            self._index.expire(t)
        if self._spec is not None:
            self._spec.expire(t)

    def _match(self, hashes: np.ndarray, hl: list[int], num_tokens: int, eligible: list[int]) -> tuple[list[int], list[int]]:
        """(matched blocks per replica, what the policy scores)."""
        match = self._index.match(hashes).tolist()
        match = match[: len(self._names)] + [0] * (len(self._names) - len(match))
        if self._spec is not None or self._policy.extends_match():
            # The index rounds its own answer to whole engine blocks (C2); what the
            # speculative index and the policy add is rounded here, with the index's k.
            base = list(match)
            if self._spec is not None:
                spec = self._spec.match(hashes).tolist()
                match = [max(a, spec[r]) if r < len(spec) else a for r, a in enumerate(match)]
            self._policy.extend_match(hl, eligible, match)
            for r in eligible:
                if match[r] != base[r]:
                    match[r] -= match[r] % self._index.engine_block(r)
        scored = list(match)
        if self._min_match > 0:
            for r in eligible:
                if min(match[r] * self._bs, num_tokens) < self._min_match:
                    scored[r] = 0
        return match, scored

    def _order(self, excluded: int) -> list[int]:
        """Candidates least recently chosen first: every tie goes to the one idle longest."""
        return [r for r in self._recency if r != excluded and self._eligible(r)]

    def _view(self, hl: list[int], num_tokens: int, session: str | None, scored: list[int], eligible: list[int]) -> View:
        return View(
            hl, num_tokens, self._bs, session, scored, self._inflight, self._queued, self._prefill_reqs,
            self._prefill_blocks, self._decode_blocks, self._waiting, self._kv, eligible,
        )  # fmt: skip

    def _pick(self, v: View, session: str | None, t: float, rng: SplitMix64) -> _Picked:
        """Keep a bound, eligible, unsaturated replica; else ask the policy (without the
        saturated bound replica when another is eligible)."""
        entry = self._sessions.get(session) if session is not None else None
        expired = entry is not None and entry.last_seen + self._cfg.session_ttl <= t
        if entry is None or expired:
            chosen, reason = self._policy.choose(v, self._order(-1), rng)
            return _Picked(chosen, reason, "none" if session is None else "new", 0, expired)
        b = entry.replica
        valid = self._eligible(b) and self._gen[b] == entry.gen
        if valid and not self._policy.saturated(v, b):
            chosen, reason = b, "session"
        else:
            chosen, reason = self._policy.choose(v, self._order(b if valid and len(v.eligible) > 1 else -1), rng)
        if valid and chosen == b:
            return _Picked(chosen, reason, "kept", 0, False)
        return _Picked(chosen, reason, "rebound", entry.blocks, False)

    def _reserve(self, chosen: int, matched: int, hl: list[int], num_tokens: int, t: float) -> int:
        p = len(hl)
        cached = min(matched * self._bs, num_tokens)
        h = self._next_handle
        self._next_handle += 1
        self._requests[h] = _Request(chosen, num_tokens - cached, p, p - matched, t)
        self._policy.reserved(h, chosen, hl)
        self._queued[chosen] += num_tokens - cached
        self._inflight[chosen] += 1
        self._prefill_reqs[chosen] += 1
        self._prefill_blocks[chosen] += p - matched
        st = self._stats
        st["routed"] += 1
        st["prompt_tokens"] = min(st["prompt_tokens"] + num_tokens, _I64_MAX)
        st["cached_tokens"] = min(st["cached_tokens"] + cached, _I64_MAX)
        return h

    def _drop_oldest_session(self, counter: str) -> None:
        key, _ = self._sessions.popitem(last=False)
        self._session_bytes -= len(key.encode("utf-8"))
        self._stats[counter] += 1

    def _update_session(self, session: str, picked: _Picked, chosen: int, blocks: int, t: float) -> None:
        sessions, ttl = self._sessions, self._cfg.session_ttl
        if picked.expired_entry:
            del sessions[session]
            self._session_bytes -= len(session.encode("utf-8"))
            self._stats["session_expirations"] += 1
        while sessions and not next(iter(sessions.values())).last_seen + ttl > t:
            self._drop_oldest_session("session_expirations")
        cur = sessions.get(session)
        if cur is None:
            sessions[session] = _Session(chosen, self._gen[chosen], blocks, t)
            self._session_bytes += len(session.encode("utf-8"))
        else:
            cur.replica, cur.gen, cur.blocks, cur.last_seen = chosen, self._gen[chosen], blocks, t
            sessions.move_to_end(session)
        # An id is at most max_session_bytes (checked on entry): the new one is never dropped.
        while len(sessions) > self._cfg.max_sessions or self._session_bytes > self._cfg.max_session_bytes:
            self._drop_oldest_session("session_evictions")

    def _check_session(self, session: Any) -> str | None:
        if session is None:
            return None
        if not isinstance(session, str):
            raise TypeError(f"session must be a str or None, got {type(session).__name__}")
        size = len(_text("session", session).encode("utf-8"))
        limit = self._cfg.max_session_bytes
        if size > limit:
            raise ValueError(f"session must be at most {limit} bytes (max_session_bytes), got {size}")
        return session

    def _route(self, hashes: np.ndarray, num_tokens: int, session: Any, now: Any) -> Decision:
        session = self._check_session(session)
        t = time.monotonic() if now is None else _now(now)
        with self._lock:
            eligible = [r for r in range(len(self._names)) if self._eligible(r)]
            if not eligible:
                raise RuntimeError("no eligible replica: every replica is removed, drained or unhealthy")
            self._expire(t)
            hl = hashes.tolist()
            match, scored = self._match(hashes, hl, num_tokens, eligible)
            rng = SplitMix64(self._rng.state)
            picked = self._pick(self._view(hl, num_tokens, session, scored, eligible), session, t, rng)
            chosen = picked.chosen
            # The one step that may still fail (a chain that contradicts the index) comes first.
            if self._cfg.mode == "approximate":
                self._index.insert(chosen, hashes, t)
            elif self._spec is not None:
                self._spec.insert(chosen, hashes, t)
            self._rng.state = rng.state
            self._recency.remove(chosen)
            self._recency.append(chosen)
            self._chosen_once[chosen] = True
            matched = match[chosen]
            h = self._reserve(chosen, matched, hl, num_tokens, t)
            if picked.binding == "rebound":
                self._stats["rebinds"] += 1
                self._stats["stranded_blocks"] += picked.stranded
            if session is not None:
                self._update_session(session, picked, chosen, len(hl), t)
            return Decision(
                self._names[chosen],  # type: ignore[arg-type]
                chosen,
                matched,
                min(matched * self._bs, num_tokens),
                num_tokens,
                picked.reason,
                picked.binding,
                picked.stranded,
                h,
            )
