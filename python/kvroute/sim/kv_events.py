"""KV cache events of the simulated engine, shaped like vLLM's.

The engine (kvroute.sim.engine) reports what its prefix cache really does with these
three dataclasses, field for field the events of vLLM's vllm/distributed/kv_events.py
(BlockStored, BlockRemoved, AllBlocksCleared) as vllm/v1/core/block_pool.py emits them:

- BlockStored: full blocks of one request became cached, one event per request and
  caching call; block_hashes continue the chain after parent_block_hash (None: from the
  root). token_ids are the blocks' tokens (empty when the request was given as block
  hashes only, as the simulator's workloads are).
- BlockRemoved: evicted blocks, one event per allocation that evicted (vLLM's
  _maybe_evict_cached_block emits one per block; a batch means the same). Like vLLM, the engine does not de-duplicate: two requests that compute the same
  block in the same step hold two cached copies, each stored and each removed by its own
  event, so a consumer that needs "is this hash cached" must count copies (replay_set does).
- AllBlocksCleared: reset_prefix_cache() emptied the cache.

The emulator encodes these to vLLM's msgpack wire form; the simulator applies them to
the router's index.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable: hashes chained after parent_block_hash."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (one copy each)."""

    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def replay(events: Iterable[KVEvent], copies: Counter[int] | None = None) -> Counter[int]:
    """Apply events to a multiset of cached hashes (hash -> copies); returns it.

    A hash with a positive count is cached. Starting from an empty Counter, replaying every
    event an engine emitted gives exactly its cache content (the engine's tests check it).
    """
    out: Counter[int] = Counter() if copies is None else copies
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                out[h] += 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                n = out[h] - 1
                if n < 0:
                    raise ValueError(f"BlockRemoved of hash {h} that is not cached")
                if n:
                    out[h] = n
                else:
                    del out[h]
        elif isinstance(ev, AllBlocksCleared):
            out.clear()
        else:
            raise TypeError(f"not a KV event: {type(ev).__name__}")
    return out


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "replay"]
