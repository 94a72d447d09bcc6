"""Block streams: what a prefix cache sees of a workload, as flat arrays.

A stream is a sequence of operations in time order. Each operation is one prompt's
chained block hashes (only full blocks, as kvroute.block_hashes makes them):

- a lookup (counted=True) asks the cache for the longest cached prefix of its first
  lookup_blocks blocks (the prompt), then stores all of its blocks (the prompt, and
  optionally the output blocks that extend its chain, which a replica caches when the
  request completes: storing them with the prompt halves the work of a replay);
- a store (counted=False) only stores blocks and counts toward no hit rate.

Its prompt_tokens are the prompt's length (the partial last block included), so a hit
rate is cached input tokens / input tokens, token-weighted as the seed's evals section
asks. `replica` optionally says which replica each operation went to.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class BlockStream:
    """Operations as flat arrays: op i's blocks are hashes[offsets[i]:offsets[i+1]].

    prompt_tokens[i]: input tokens of op i (0 for stores). counted[i]: a lookup.
    replica[i]: the replica op i went to (-1 or None: none given). block_tokens: tokens
    per block. arrival[i]: seconds (optional, informative). lookup_blocks[i]: how many
    leading blocks op i looks up (None: all of a lookup's blocks).
    """

    hashes: np.ndarray
    offsets: np.ndarray
    prompt_tokens: np.ndarray
    counted: np.ndarray
    block_tokens: int
    replica: np.ndarray | None = None
    arrival: np.ndarray | None = None
    lookup_blocks: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.offsets) - 1
        if n < 0 or self.offsets[0] != 0 or self.offsets[-1] != len(self.hashes):
            raise ValueError("offsets must start at 0 and end at len(hashes)")
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must not decrease")
        for name in ("prompt_tokens", "counted", "replica", "arrival", "lookup_blocks"):
            arr = getattr(self, name)
            if arr is not None and len(arr) != n:
                raise ValueError(f"{name} must have one entry per operation ({n}), got {len(arr)}")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, (int, np.integer)):
            raise TypeError(f"block_tokens must be an int, got {type(self.block_tokens).__name__}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    @property
    def num_ops(self) -> int:
        """Number of operations (lookups and stores)."""
        return len(self.offsets) - 1

    def looked_up(self) -> np.ndarray:
        """Blocks each op looks up (0 for stores)."""
        lens = np.diff(self.offsets)
        n = lens if self.lookup_blocks is None else np.minimum(self.lookup_blocks, lens)
        return np.where(self.counted, n, 0)

    @property
    def input_tokens(self) -> int:
        """Total input tokens of the lookups."""
        return int(self.prompt_tokens[self.counted].sum())

    def blocks(self, i: int) -> np.ndarray:
        """Operation i's chained block hashes."""
        return self.hashes[self.offsets[i]:self.offsets[i + 1]]

    def lookups(self) -> Iterable[int]:
        """Indices of the lookups."""
        return np.flatnonzero(self.counted).tolist()

    def with_replica(self, replica: Sequence[int] | np.ndarray) -> BlockStream:
        """The same stream with a replica per operation."""
        return BlockStream(self.hashes, self.offsets, self.prompt_tokens, self.counted, self.block_tokens,
                           np.asarray(replica, dtype=np.int64), self.arrival, self.lookup_blocks)


def build(ops: Sequence[tuple[np.ndarray, int, bool]], block_tokens: int, *,
          arrival: Sequence[float] | None = None, replica: Sequence[int] | None = None,
          lookup_blocks: Sequence[int] | None = None) -> BlockStream:
    """A stream from (hashes, prompt_tokens, counted) triples in time order."""
    lengths = np.fromiter((len(h) for h, _, _ in ops), dtype=np.int64, count=len(ops))
    offsets = np.zeros(len(ops) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    hashes = (np.concatenate([np.asarray(h, dtype=np.uint64) for h, _, _ in ops]) if ops
              else np.zeros(0, dtype=np.uint64))
    return BlockStream(
        hashes, offsets,
        np.fromiter((t for _, t, _ in ops), dtype=np.int64, count=len(ops)),
        np.fromiter((c for _, _, c in ops), dtype=bool, count=len(ops)),
        block_tokens,
        None if replica is None else np.asarray(replica, dtype=np.int64),
        None if arrival is None else np.asarray(arrival, dtype=np.float64),
        None if lookup_blocks is None else np.asarray(lookup_blocks, dtype=np.int64),
    )


def from_workload(workload: Any, *, stores: bool = True) -> BlockStream:
    """A kvroute.sim Workload as a stream in arrival order with zero service time.

    Each turn arrives at its client's start plus the think times before it (a closed-loop
    client's answers take no time here) and looks up its prompt; with `stores`, its
    prompt + output blocks (Turn.after_hashes) are stored with it, as a replica caches
    them when the turn completes.
    """
    events: list[tuple[float, int, int, int]] = []
    for c, client in enumerate(workload.clients):
        t = float(client.start)
        for k, turn in enumerate(client.turns):
            if k:
                t += float(turn.think_time)
            events.append((t, c, k, 0))
    events.sort()
    ops: list[tuple[np.ndarray, int, bool]] = []
    times: list[float] = []
    looked: list[int] = []
    for t, c, k, _ in events:
        turn = workload.clients[c].turns[k]
        ops.append((turn.after_hashes if stores else turn.hashes, int(turn.prompt_tokens), True))
        looked.append(len(turn.hashes))
        times.append(t)
    return build(ops, workload.block_tokens, arrival=times, lookup_blocks=looked)


@dataclass(frozen=True, eq=False)
class Trace:
    """A trace file read for diagnosis: its lookup stream, the same requests as a
    simulator workload (single-turn clients at their timestamps), and for a token trace
    the prompts' token ids (None for Mooncake)."""

    stream: BlockStream
    workload: Any
    prompts: list[np.ndarray] | None
    path: str
    format: str


def read_jsonl(path: str | os.PathLike[str], fmt: str = "mooncake", *, block_size: int | None = None,
               limit: int | None = None, output_tokens: int = 256, rate: float | None = None) -> Trace:
    """Read a trace file.

    mooncake: Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids of
    512-token blocks; block_size overrides 512). tokens: one prompt a line, a JSON array
    of token ids or an object with "tokens" and optional "timestamp" (ms) and
    "output_length" (default output_tokens); hashed with kvroute.block_hashes at
    block_size (default 16). rate: requests per second for a token trace without
    timestamps (default 1). Requests are taken in file order; limit: the first `limit`.
    """
    from ..sim.workloads import Client, TraceParams, Turn, Workload, trace

    if fmt == "mooncake":
        wl = trace(path, TraceParams(block_tokens=block_size or 512, limit=limit))
        ops = [(c.turns[0].hashes, int(c.turns[0].prompt_tokens), True) for c in wl.clients]
        return Trace(build(ops, wl.block_tokens, arrival=[c.start for c in wl.clients]), wl, None,
                     os.fspath(path), fmt)
    if fmt != "tokens":
        raise ValueError(f"format must be 'mooncake' or 'tokens', got {fmt!r}")
    from .._backend import backend

    bs = block_size or 16
    prompts, times, outs = _read_token_lines(path, limit, output_tokens)
    if not any(times):
        step = 1.0 / (rate or 1.0)
        times = [i * step for i in range(len(prompts))]
    hashes = [backend.block_hashes(p, bs) for p in prompts]
    clients = tuple(Client(t, (Turn(h, len(p), o, h),)) for h, p, t, o in zip(hashes, prompts, times, outs))
    wl = Workload("tokens", bs, clients, f"{os.path.basename(os.fspath(path))}: {len(prompts)} prompts")
    return Trace(build([(h, len(p), True) for h, p in zip(hashes, prompts)], bs, arrival=times), wl, prompts,
                 os.fspath(path), fmt)


def _read_token_lines(path: str | os.PathLike[str], limit: int | None,
                      output_tokens: int) -> tuple[list[np.ndarray], list[float], list[int]]:
    prompts: list[np.ndarray] = []
    times: list[float] = []
    outs: list[int] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts, out = 0.0, output_tokens
                if isinstance(rec, dict):
                    ts = float(rec.get("timestamp", 0.0)) / 1000.0
                    out = int(rec.get("output_length", output_tokens))
                    rec = rec["tokens"]
                toks = np.asarray(rec, dtype=np.int64)
                if toks.ndim != 1 or out < 1:
                    raise ValueError("tokens must be a flat list of ints and output_length >= 1")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a token-id prompt ({exc})") from None
            prompts.append(toks)
            times.append(ts)
            outs.append(out)
    order = np.argsort(np.asarray(times), kind="stable")
    return [prompts[i] for i in order], [times[i] for i in order], [outs[i] for i in order]


__all__ = ["BlockStream", "Trace", "build", "from_workload", "read_jsonl"]
