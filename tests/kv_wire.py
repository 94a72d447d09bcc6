"""Fake engines for the KV event tests: payload encoders for each wire layout of kv-events.md
and a simulated engine block cache whose true contents the tests compare the index with.

Encodings (kv-events.md A2, A3):
- "vllm-array": vLLM before #42892, each event a positional array with the tag first; `fields`
  sets how many BlockStored fields a given vLLM version sends (5 = v0.9.0 ... 11 = current).
- "vllm-map": vLLM after #42892, each event a map with a "type" key, optional fields omitted.
- "sglang": SGLang, positional arrays with medium, a trailing {"cache_salt"} map when salted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

import kvroute.reference as R

_ENC = msgspec.msgpack.Encoder()
FORMATS = ("vllm-array", "vllm-map", "sglang")


def stored(fmt: str, hashes: list[Any], parent: Any, tokens: list[int], block_size: int,
           medium: str | None = "GPU", fields: int = 11) -> Any:
    """One BlockStored event in the given encoding."""
    if fmt == "vllm-array":
        full = ["BlockStored", hashes, parent, tokens, block_size, None, medium, None, None, 0,
                "full_attention", None]
        return full[: fields + 1]
    if fmt == "vllm-map":
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": [None] * len(hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if fmt == "sglang":
        return ["BlockStored", hashes, parent, tokens, block_size, None, medium]
    raise ValueError(fmt)


def removed(fmt: str, hashes: list[Any], medium: str | None = "GPU") -> Any:
    """One BlockRemoved event in the given encoding."""
    if fmt == "vllm-array":
        return ["BlockRemoved", hashes, medium, 0]
    if fmt == "vllm-map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def cleared(fmt: str) -> Any:
    """One AllBlocksCleared event in the given encoding."""
    return {"type": "AllBlocksCleared"} if fmt == "vllm-map" else ["AllBlocksCleared"]


def batch(events: list[Any], ts: float = 1_789_095_808.83, rank: int | None = 0) -> bytes:
    """A msgpack batch: [ts, events, rank], or [ts, events] when rank is None (v0.9.0)."""
    return _ENC.encode([ts, events] if rank is None else [ts, events, rank])


class Engine:
    """A simulated engine prefix cache of `capacity` physical blocks, LRU eviction of free ones.

    Engine hashes are opaque ids derived from each block's token prefix. serve(tokens) hits
    the request's cached prefix, then stores every later full block as a new physical block,
    even when a block with that hash is already cached (engines do not de-duplicate, so the
    same hash can be stored twice and needs two removals). Evictions come first, one
    BlockRemoved per physical block, like vLLM's lazy eviction on reallocation; blocks the
    request uses are never evicted. truth() is what a PrefixIndex replica should hold: the
    kvroute hashes (router block size, salt) of every cached block.
    """

    def __init__(self, fmt: str, capacity: int, engine_block_size: int, block_size: int,
                 salt: Any = None, hash_style: str = "uint") -> None:
        self.fmt = fmt
        self.capacity = capacity
        self.ebs = engine_block_size
        self.bs = block_size
        self.salt = salt
        self.hash_style = hash_style  # "uint", "int" (signed int64) or "bytes" (32-byte digests)
        self.blocks: OrderedDict[int, int] = OrderedDict()  # physical id -> hash, LRU first
        self.count: dict[int, int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.announced: set[int] = set()  # hashes whose last event was a store
        self._next_id = 0

    def _hash(self, prefix: tuple[int, ...]) -> int:
        h = R.xxh3_64(repr(prefix).encode("ascii"), 7)
        self.prefix_of[h] = prefix
        return h

    def wire(self, h: int) -> Any:
        """The engine hash as this engine puts it on the wire."""
        if self.hash_style == "int":
            return h - (1 << 64) if h >= 1 << 63 else h
        if self.hash_style == "bytes":
            return bytes(24) + h.to_bytes(8, "big")
        return h

    def serve(self, tokens: list[int]) -> list[Any]:
        """Cache one request's full blocks; returns the step's events."""
        return self.step([tokens])

    def step(self, requests: list[list[int]]) -> list[Any]:
        """One engine step running several requests at once; returns its events.

        Requests of one step only hit blocks cached before the step, so two requests sharing
        a new prefix both store it: the same hash twice, on two physical blocks, as in vLLM.
        Blocks the step's requests use are not evicted during it.
        """
        before = {h for h, c in self.count.items() if c > 0}
        used: set[int] = set()
        events: list[Any] = []
        for tokens in requests:
            events += self._serve(tokens, before, used)
        return events

    def _serve(self, tokens: list[int], before: set[int], used: set[int]) -> list[Any]:
        n = len(tokens) // self.ebs
        parent: int | None = None
        i = 0
        while i < n:
            h = self._hash(tuple(tokens[: (i + 1) * self.ebs]))
            pid = next((b for b, bh in self.blocks.items() if bh == h), None) if h in before else None
            if pid is None:
                break
            self.blocks.move_to_end(pid)
            used.add(pid)
            parent = h
            i += 1
        new = [self._hash(tuple(tokens[: (j + 1) * self.ebs])) for j in range(i, n)]
        free = [b for b in self.blocks if b not in used]
        new = new[: max(0, self.capacity - len(used))]
        evicted: list[int] = []
        while len(self.blocks) + len(new) > self.capacity:
            victim = free.pop(0)
            evicted.append(self.blocks.pop(victim))
            self.count[evicted[-1]] -= 1
        events: list[Any] = []
        if evicted:
            events.append(removed(self.fmt, [self.wire(h) for h in evicted]))
            self.announced.difference_update(evicted)
        if new:
            for h in new:
                used.add(self._next_id)
                self.blocks[self._next_id] = h
                self._next_id += 1
                self.count[h] = self.count.get(h, 0) + 1
            self.announced.update(new)
            toks = tokens[i * self.ebs : (i + len(new)) * self.ebs]
            events.append(stored(self.fmt, [self.wire(h) for h in new],
                                 None if parent is None else self.wire(parent), toks, self.ebs))
        return events

    def clear(self) -> list[Any]:
        """reset_prefix_cache: the engine drops everything."""
        self.blocks.clear()
        self.count.clear()
        self.announced.clear()
        return [cleared(self.fmt)]

    def truth(self) -> list[int]:
        """Sorted kvroute hashes of every cached block: an index replica may hold no more."""
        return self._kv({h for h, c in self.count.items() if c > 0})

    def claimable(self) -> list[int]:
        """Sorted kvroute hashes an index replica holds under kvroute's duplicate rule: a hash
        whose last event was a store (one removal drops it even if a second physical copy
        remains: the documented under-claim). A subset of truth()."""
        return self._kv(self.announced)

    def reuse(self, tokens: list[int], claimed: bool = False) -> int:
        """Router blocks of `tokens` the engine would reuse: its longest cached prefix of whole
        engine blocks (claimed: of blocks whose last event was a store, what kvroute keeps)."""
        held = self.announced if claimed else {h for h, c in self.count.items() if c > 0}
        i = 0
        while (i + 1) * self.ebs <= len(tokens) and self._hash(tuple(tokens[: (i + 1) * self.ebs])) in held:
            i += 1
        return i * self.ebs // self.bs

    def _kv(self, hashes: set[int]) -> list[int]:
        out: set[int] = set()
        k = self.ebs // self.bs
        for h in hashes:
            hs = R.block_hashes(list(self.prefix_of[h]), self.bs, salt=self.salt)
            out.update(int(x) for x in hs[len(hs) - k :])
        return sorted(out)
