"""Workloads for the fleet simulator: who asks what, and when.

A workload is a list of clients. A client sends a chain of requests (turns): the first
arrives at the client's start time, each later one `think_time` seconds after the previous
one completed (closed loop, as a person or an agent waits for the answer). A chat user
holds several conversations one after another, each a session the router may bind; a
client with a single turn and a fixed start time is one request of an open-loop trace.

Prompts are described by their chained block hashes, not tokens: equal hashes at equal
positions mean a reusable prefix, which is all a prefix cache and a router can see. Only
full blocks are hashed, as in kvroute.block_hashes.

Three generators:

- chat(params, replicas, seed): multi-turn conversations, the explainer's workload
  (ChatParams documents every distribution).
- shared_prefix(params, seed): SGLang's generated-shared-prefix benchmark.
- trace(path, params): a Mooncake JSONL trace (512-token blocks).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import numpy as np

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, eq=False)
class Turn:
    """One request.

    hashes: chained hashes of the prompt's full blocks (uint64). prompt_tokens: prompt
    length. output_tokens: tokens generated. after_hashes: the full blocks of prompt +
    output, which the replica caches when the turn completes (a prefix extension of
    `hashes`). think_time: seconds between the client's previous completion and this
    arrival (ignored for a client's first turn). session: the session id given to the
    router (None: none). first: whether this is the first turn of its conversation (a
    cold start, reported separately).
    """

    hashes: np.ndarray
    prompt_tokens: int
    output_tokens: int
    after_hashes: np.ndarray
    think_time: float = 0.0
    session: str | None = None
    first: bool = True


@dataclass(frozen=True, eq=False)
class Client:
    """A closed-loop client: a chain of turns starting at `start` seconds."""

    start: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, eq=False)
class Workload:
    """Clients plus the block size (tokens per hash) their hashes were made with."""

    name: str
    block_tokens: int
    clients: tuple[Client, ...]
    description: str = ""

    @property
    def num_requests(self) -> int:
        """Total number of requests over all clients."""
        return sum(len(c.turns) for c in self.clients)

    @property
    def input_tokens(self) -> int:
        """Total prompt tokens over all requests."""
        return sum(t.prompt_tokens for c in self.clients for t in c.turns)

    def turns(self) -> list[Turn]:
        """Every request, client by client."""
        return [t for c in self.clients for t in c.turns]

    def scaled(self, rate: float) -> "Workload":
        """The same requests arriving `rate` times as fast: start times and think times
        divided by rate (an open-loop trace's arrival rate is multiplied by rate; a
        closed-loop client thinks rate times less between an answer and its next turn)."""
        _check_float("rate", rate, 0.0, strict=True)
        if rate == 1.0:
            return self
        clients = tuple(Client(c.start / rate, tuple(replace(t, think_time=t.think_time / rate) for t in c.turns))
                        for c in self.clients)
        return Workload(self.name, self.block_tokens, clients, f"{self.description}, rate x{rate:g}")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection on uint64, so distinct ids stay distinct."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


# --------------------------------------------------------------------------------------
# chat


@dataclass(frozen=True)
class ChatParams:
    """The multi-turn chat workload (the explainer's), with its distributions.

    sessions_per_replica * replicas users chat at once (16 per replica). Each user holds
    conversations_per_user conversations one after another, so about 16 sessions per
    replica are live for most of the run; each conversation is one router session.

    Per conversation, independently:

    - turns ~ min(Geometric(1 / mean_turns), max_turns): at least 1, mean mean_turns
      before the cap. Its long tail is what lets a few long sessions dominate a replica
      under sticky routing.
    - a scale s ~ LogNormal(0, session_sigma), drawn once: long agent-like sessions also
      have long turns.
    - each turn adds a user message of s * LogNormal(log(user_median), user_sigma) tokens
      and then s * LogNormal(log(output_median), output_sigma) output tokens. The prompt
      of turn k is the system prompt, every earlier message and answer, and turn k's
      message.
    - think_time ~ LogNormal(log(think_median), think_sigma) seconds between an answer and
      the next turn, and between a user's conversations. Users start uniformly in
      [0, start_window).
    - system_prompt_tokens are shared by every conversation (0: none).

    Then every message and answer length is multiplied by one common factor (and rounded;
    messages >= 1 token, answers in [8, max_output]) so that the mean final history of a
    conversation (all its prompts and answers) is history_tokens: the default fleet cache,
    163,840 tokens per replica, then holds the full history of exactly 10 sessions, fewer
    than the 16 per replica, so every router has to evict (the explainer's setting).
    The medians only set the shape (message/answer ratio) before that scaling.
    """

    sessions_per_replica: int = 16
    conversations_per_user: int = 4
    history_tokens: int = 16_384
    mean_turns: float = 6.0
    max_turns: int = 40
    session_sigma: float = 0.5
    user_median: float = 1500.0
    user_sigma: float = 0.6
    output_median: float = 450.0
    output_sigma: float = 0.5
    max_output: int = 4096
    think_median: float = 20.0
    think_sigma: float = 0.3
    start_window: float = 60.0
    system_prompt_tokens: int = 0
    block_tokens: int = 16

    def __post_init__(self) -> None:
        _check_int("sessions_per_replica", self.sessions_per_replica, 1)
        _check_int("conversations_per_user", self.conversations_per_user, 1)
        _check_float("mean_turns", self.mean_turns, 1.0)
        _check_int("max_turns", self.max_turns, 1)
        for name in ("session_sigma", "user_sigma", "output_sigma", "start_window", "think_sigma"):
            _check_float(name, getattr(self, name), 0.0)
        for name in ("user_median", "output_median", "think_median"):
            _check_float(name, getattr(self, name), 0.0, strict=True)
        _check_int("max_output", self.max_output, 8)
        _check_int("system_prompt_tokens", self.system_prompt_tokens, 0)
        _check_int("block_tokens", self.block_tokens, 1)
        _check_int("history_tokens", self.history_tokens, self.system_prompt_tokens + 1)


def chat(params: ChatParams | None = None, replicas: int = 8, seed: int = 0) -> Workload:
    """The chat workload for a fleet of `replicas` (users scale with the fleet)."""
    p = params or ChatParams()
    _check_int("replicas", replicas, 1)
    rng = np.random.default_rng([seed, 1])
    n_users = p.sessions_per_replica * replicas
    bt = p.block_tokens
    # Draw every conversation first: the common length factor needs all of them.
    drawn = []
    for _ in range(n_users):
        start = float(rng.uniform(0.0, p.start_window)) if p.start_window > 0 else 0.0
        convs = []
        for _ in range(p.conversations_per_user):
            n_turns = min(int(rng.geometric(1.0 / p.mean_turns)), p.max_turns)
            scale = float(rng.lognormal(0.0, p.session_sigma))
            users = scale * rng.lognormal(math.log(p.user_median), p.user_sigma, n_turns)
            outs = scale * rng.lognormal(math.log(p.output_median), p.output_sigma, n_turns)
            thinks = rng.lognormal(math.log(p.think_median), p.think_sigma, n_turns)
            convs.append((users, outs, thinks))
        drawn.append((start, convs))
    raw = float(np.mean([u.sum() + o.sum() for _, convs in drawn for u, o, _ in convs]))
    factor = (p.history_tokens - p.system_prompt_tokens) / raw
    system_blocks = p.system_prompt_tokens // bt
    # Conversation-private hashes have the top bit clear, the shared system prompt's set.
    system_hashes = rng.integers(0, 1 << 63, size=system_blocks, dtype=np.uint64) | np.uint64(1 << 63)
    clients = []
    for u, (start, convs) in enumerate(drawn):
        turns: list[Turn] = []
        for c, (users_f, outs_f, thinks) in enumerate(convs):
            users = np.maximum(1, np.rint(users_f * factor)).astype(np.int64)
            outs = np.clip(np.rint(outs_f * factor), 8, p.max_output).astype(np.int64)
            total = p.system_prompt_tokens + int(users.sum() + outs.sum())
            # One stream of blocks per conversation; each turn's prompt is a prefix of it.
            own = rng.integers(0, 1 << 63, size=total // bt - system_blocks, dtype=np.uint64)
            stream = np.concatenate([system_hashes, own])
            history = p.system_prompt_tokens
            sid = f"chat-{u}-{c}"
            for k in range(len(users)):
                prompt = history + int(users[k])
                after = prompt + int(outs[k])
                turns.append(Turn(stream[: prompt // bt], prompt, int(outs[k]), stream[: after // bt],
                                  float(thinks[k]), sid, k == 0))
                history = after
        clients.append(Client(start, tuple(turns)))
    clients.sort(key=lambda x: x.start)
    return Workload("chat", bt, tuple(clients),
                    f"{n_users} chat users ({p.sessions_per_replica} per replica) x "
                    f"{p.conversations_per_user} conversations, seed {seed}")


# --------------------------------------------------------------------------------------
# shared prefix


@dataclass(frozen=True)
class SharedPrefixParams:
    """SGLang's generated-shared-prefix benchmark (bench_serving --dataset-name
    generated-shared-prefix): `groups` system prompts of system_tokens each, and
    prompts_per_group questions of question_tokens under each; every request outputs
    output_tokens. Requests are shuffled (seeded). rate: None sends them all at t=0 (the
    published setting), else Poisson arrivals at `rate` requests per second.
    """

    groups: int = 64
    prompts_per_group: int = 16
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    rate: float | None = None
    block_tokens: int = 16

    def __post_init__(self) -> None:
        _check_int("groups", self.groups, 1)
        _check_int("prompts_per_group", self.prompts_per_group, 1)
        _check_int("system_tokens", self.system_tokens, 0)
        _check_int("question_tokens", self.question_tokens, 1)
        _check_int("output_tokens", self.output_tokens, 1)
        if self.rate is not None:
            _check_float("rate", self.rate, 0.0, strict=True)
        _check_int("block_tokens", self.block_tokens, 1)


def shared_prefix(params: SharedPrefixParams | None = None, seed: int = 0) -> Workload:
    """The generated-shared-prefix workload as single-turn requests."""
    p = params or SharedPrefixParams()
    rng = np.random.default_rng([seed, 2])
    bt = p.block_tokens
    prompt = p.system_tokens + p.question_tokens
    requests = []
    for g in range(p.groups):
        system = rng.integers(0, 1 << 63, size=p.system_tokens // bt, dtype=np.uint64)
        for q in range(p.prompts_per_group):
            # The question's blocks continue the system prompt's chain (the first may
            # straddle the boundary); output blocks continue the question's.
            own = rng.integers(0, 1 << 63, size=(prompt + p.output_tokens) // bt - len(system),
                               dtype=np.uint64)
            stream = np.concatenate([system, own])
            requests.append(Turn(stream[: prompt // bt], prompt, p.output_tokens, stream))
    order = rng.permutation(len(requests))
    if p.rate is None:
        starts = np.zeros(len(requests))
    else:
        starts = np.cumsum(rng.exponential(1.0 / p.rate, len(requests)))
    clients = tuple(Client(float(starts[i]), (requests[j],)) for i, j in enumerate(order))
    how = "all at t=0" if p.rate is None else f"Poisson {p.rate:g} req/s"
    return Workload("shared-prefix", bt, clients,
                    f"{p.groups} groups x {p.prompts_per_group} prompts, {p.system_tokens}+"
                    f"{p.question_tokens} tokens, output {p.output_tokens}, {how}, seed {seed}")


# --------------------------------------------------------------------------------------
# trace


@dataclass(frozen=True)
class TraceParams:
    """How a Mooncake JSONL trace is read.

    block_tokens: tokens per hash id (512 in Mooncake's traces). time_scale: arrival
    times are timestamp_ms / 1000 * time_scale (below 1 compresses the trace, raising
    the load). limit: read only the first `limit` requests (None: all). Only the
    input_length // block_tokens full blocks of a prompt are cached and matched; the
    trace has no ids for output blocks, so a completed request leaves only its prompt's
    blocks in the cache.
    """

    block_tokens: int = 512
    time_scale: float = 1.0
    limit: int | None = None

    def __post_init__(self) -> None:
        _check_int("block_tokens", self.block_tokens, 1)
        _check_float("time_scale", self.time_scale, 0.0)
        if self.limit is not None:
            _check_int("limit", self.limit, 0)


def trace(path: str | os.PathLike[str], params: TraceParams | None = None) -> Workload:
    """A Mooncake trace as single-turn requests at their timestamps."""
    p = params or TraceParams()
    clients: list[Client] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if p.limit is not None and len(clients) >= p.limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"])
                n_in = int(rec["input_length"])
                n_out = int(rec["output_length"])
                ids = rec["hash_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record ({exc})") from None
            if n_in < 0 or n_out < 0 or not isinstance(ids, list):
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record (bad lengths or hash_ids)")
            full = min(n_in // p.block_tokens, len(ids))
            # The ids are small chained-block numbers; a bijective mix spreads them over
            # uint64 so they cannot collide with other hashes an index may hold.
            hashes = _mix64(np.asarray(ids[:full], dtype=np.uint64))
            clients.append(Client(ts / 1000.0 * p.time_scale,
                                  (Turn(hashes, n_in, max(n_out, 1), hashes),)))
    clients.sort(key=lambda c: c.start)
    return Workload("trace", p.block_tokens, tuple(clients),
                    f"{os.path.basename(os.fspath(path))}: {len(clients)} requests, time scale {p.time_scale:g}")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_float(name: str, value: object, low: float, *, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < low or (strict and v == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {v!r}")


__all__ = ["Turn", "Client", "Workload", "ChatParams", "SharedPrefixParams", "TraceParams",
           "chat", "shared_prefix", "trace"]
