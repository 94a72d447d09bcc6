"""Miss-ratio curves of a prefix cache: hit rate as a function of cache size.

The cache modelled is the one engines run and kvroute.sim simulates: a prompt hits its
longest cached prefix, then all of its blocks are stored and refreshed deepest first
(root-most most recent), and the least recently used block is evicted while the cache
holds more than C blocks (vLLM frees a request's blocks in reverse order so the tail is
evicted first: vllm/v1/core/single_type_kv_cache_manager.py free(), block_pool.py
free_blocks(); kvroute.PrefixIndex(capacity=C) does the same).

Why an LRU stack works for a *prefix* cache: every access to a block is an access to its
parent (chained hashes), refreshed right after it, so a parent is always more recent than
any of its children. The cache of size C is then the top C of one LRU stack of blocks,
it is prefix-closed, and a prompt's cached prefix is exactly its blocks whose stack
distance at lookup (distinct blocks used since) is below C. Counting those per block
gives the prefix hit: no block past the first miss can be within C. LRU is a stack
algorithm, so one pass yields every cache size (Mattson et al., 1970). A prompt's
distances are all read before any of its blocks is refreshed (lookup, then store).

To run in bounded memory at millions of blocks a second, distances come from SHARDS
(Waldspurger, Park, Garthwaite, Ahmad: "Efficient MRC Construction with SHARDS", FAST
2015): only blocks whose hash falls under a threshold T are tracked (spatial sampling at
rate R = T / 2**64, consistent across references to one block), a sampled distance d
stands for d / R, and each sampled reference stands for 1 / R references. Fixed-size
SHARDS bounds the tracked set to `max_blocks`: when it is exceeded, the block with the
largest hash leaves and T drops to its hash. SHARDS-adj (section 4.3) adds the difference
between the references seen and the weight sampled to the smallest distance, which
removes most of the error from a few very hot blocks (every prompt's block 0). The
sampling filter is one vectorized numpy pass; the stack distances of the sampled blocks
come from a Fenwick tree over their last-use times, compacted when its times run out.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .stream import BlockStream

_TWO64 = float(1 << 64)
_MULT = np.uint64(0x9E3779B97F4A7C15)
#: Distances below this many blocks are histogrammed exactly; above, in log bins of
#: _LOG_STEP (0.1%), so a curve's size resolution is 0.1% above 4,096 blocks.
_LINEAR = 4096
_LOG_STEP = 0.001
_CHUNK = 1 << 20
#: Distances read but not yet histogrammed (add() flushes at this many; curves flush first).
_PENDING = 4096


def sample_keys(hashes: np.ndarray) -> np.ndarray:
    """The sampling key of each block hash (a 1-D array): a multiplicative mix, so ids that
    are small integers (a trace's remapped ids) spread over uint64 like real hashes. Integer
    arithmetic on arrays wraps modulo 2**64 without a warning (numpy checks overflow only on
    scalars), which is the mix wanted."""
    x = np.asarray(hashes, dtype=np.uint64) * _MULT
    x ^= x >> np.uint64(29)
    x *= _MULT
    return x


def _bin_upper(c: float) -> int:
    """Number of leading bins whose every distance is < c."""
    if c <= _LINEAR:
        return max(0, math.ceil(c))
    return _LINEAR + int(math.log(c / _LINEAR) / _LOG_STEP)


class _Fenwick:
    """Prefix sums over last-use times: bit t is 1 while time t is some block's last use."""

    __slots__ = ("n", "tree", "total")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.total = 0

    def add(self, i: int, v: int) -> None:
        tree = self.tree
        n = self.n
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i
        self.total += v

    def above(self, i: int) -> int:
        """How many set times are > i."""
        tree = self.tree
        s = 0
        i += 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return self.total - s

    def rebuild(self, times: np.ndarray) -> None:
        """Set exactly the given (sorted, distinct) times."""
        a = np.zeros(self.n + 1, dtype=np.int64)
        a[times + 1] = 1
        prefix = np.cumsum(a)
        idx = np.arange(self.n + 1)
        low = idx & -idx
        tree = prefix - prefix[idx - low]
        tree[0] = 0
        self.tree = tree.tolist()
        self.total = int(len(times))


@dataclass(frozen=True)
class Curve:
    """A miss-ratio curve: hit rate (cached input tokens / input tokens) per cache size.

    sizes: cache sizes in blocks; hit_rate: estimated prefix-cache hit rate at each.
    block_tokens: tokens per block. rate: the final SHARDS sampling rate (1.0 = exact).
    tracked: blocks tracked at the end (<= max_blocks). input_tokens, lookups, blocks:
    what the stream held (lookups only).
    """

    sizes: np.ndarray
    hit_rate: np.ndarray
    block_tokens: int
    rate: float
    tracked: int
    input_tokens: int
    lookups: int
    blocks: int

    def size_for(self, target: float) -> int | None:
        """The smallest listed cache size (blocks) whose hit rate reaches target, or None."""
        ok = np.flatnonzero(self.hit_rate >= target)
        return int(self.sizes[ok[0]]) if ok.size else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {"sizes_blocks": self.sizes.tolist(), "sizes_tokens": (self.sizes * self.block_tokens).tolist(),
                "hit_rate": [round(float(x), 6) for x in self.hit_rate], "block_tokens": self.block_tokens,
                "sampling_rate": self.rate, "tracked_blocks": self.tracked, "input_tokens": self.input_tokens,
                "lookups": self.lookups, "blocks": self.blocks}


class Shards:
    """Fixed-size SHARDS over prefix-cache lookups (see the module docstring).

    block_tokens: tokens per block. rate: the initial sampling rate in (0, 1] (1: exact
    until max_blocks blocks are tracked). max_blocks: the most blocks tracked at once;
    memory is O(max_blocks) (about 200 bytes each) whatever the stream's length.
    adjust: apply SHARDS-adj. Feed with add() (one operation) or feed() (a BlockStream).
    """

    def __init__(self, block_tokens: int, *, rate: float = 1.0, max_blocks: int = 65_536,
                 adjust: bool = True) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if not isinstance(rate, (int, float)) or not 0.0 < float(rate) <= 1.0:
            raise ValueError(f"rate must be a number in (0, 1], got {rate!r}")
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self.block_tokens = int(block_tokens)
        self.max_blocks = int(max_blocks)
        self.adjust = bool(adjust)
        self._threshold = min((1 << 64) - 1, int(float(rate) * _TWO64))
        self._last: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []  # (-key, hash): the largest key on top
        self._fen = _Fenwick(4 * self.max_blocks + 64)
        self._clock = 0
        self._bins = np.zeros(_LINEAR + int(math.log(1e13) / _LOG_STEP) + 2, dtype=np.float64)
        self._pending_d: list[float] = []
        self._pending_w: list[float] = []
        self._weight = 0.0  # sampled lookup references, each weighted 1 / R
        self.blocks = 0
        self.lookups = 0
        self.input_tokens = 0

    @property
    def rate(self) -> float:
        """The current sampling rate."""
        return (self._threshold + 1) / _TWO64

    @property
    def tracked(self) -> int:
        """Blocks tracked now."""
        return len(self._last)

    def add(self, hashes: np.ndarray, prompt_tokens: int, counted: bool = True) -> None:
        """One operation: a lookup of a prompt's blocks (counted) or a store. What
        feed_arrays does for a one-operation stream, without its per-stream array work: a
        gateway calls this twice per request (the pooled curve and the replica's)."""
        h = np.asarray(hashes, dtype=np.uint64)
        counted = bool(counted)
        if counted:
            self.blocks += len(h)
            self.lookups += 1
            self.input_tokens += int(prompt_tokens)
        if len(h):
            keys = sample_keys(h)
            pos = np.nonzero(keys <= np.uint64(self._threshold))[0]
            if pos.size:
                self._op(h[pos].tolist(), keys[pos].tolist(), [counted] * int(pos.size))
        if len(self._pending_d) >= _PENDING:
            self._flush()

    def feed(self, stream: BlockStream) -> Shards:
        """Every operation of a stream, in order. Returns self."""
        if stream.block_tokens != self.block_tokens:
            raise ValueError(f"stream block_tokens {stream.block_tokens} != estimator's {self.block_tokens}")
        self.feed_arrays(stream.hashes, stream.offsets, stream.prompt_tokens, stream.counted,
                         stream.lookup_blocks)
        return self

    def feed_arrays(self, hashes: np.ndarray, offsets: np.ndarray, prompt_tokens: np.ndarray,
                    counted: np.ndarray, lookup_blocks: np.ndarray | None = None) -> None:
        """Operations as flat arrays (BlockStream's layout)."""
        n_ops = len(offsets) - 1
        lens = np.diff(offsets)
        looked = np.where(counted, lens if lookup_blocks is None else np.minimum(lookup_blocks, lens), 0)
        self.blocks += int(looked.sum())
        self.lookups += int(np.count_nonzero(counted))
        self.input_tokens += int(prompt_tokens[counted].sum())
        start = 0
        while start < n_ops:
            # Whole operations per chunk, about _CHUNK blocks each.
            stop = int(np.searchsorted(offsets, offsets[start] + _CHUNK, side="right"))
            stop = min(max(stop - 1, start + 1), n_ops)
            lo, hi = int(offsets[start]), int(offsets[stop])
            keys = sample_keys(hashes[lo:hi])
            pos = np.flatnonzero(keys <= np.uint64(self._threshold))
            if pos.size:
                op = np.searchsorted(offsets[start:stop + 1], pos + lo, side="right") - 1 + start
                # A sampled block is looked up when it lies within its op's lookup_blocks.
                look = (pos + lo - offsets[op]) < looked[op]
                self._sampled(hashes[lo + pos].tolist(), keys[pos].tolist(), op.tolist(), look.tolist())
            start = stop
        self._flush()

    def _sampled(self, hs: list[int], ks: list[int], ops: list[int], look: list[bool]) -> None:
        i = 0
        n = len(hs)
        while i < n:
            j = i + 1
            while j < n and ops[j] == ops[i]:
                j += 1
            self._op(hs[i:j], ks[i:j], look[i:j])
            i = j

    def _op(self, hs: list[int], ks: list[int], look: list[bool]) -> None:
        """One operation's sampled blocks (root-most first): read the distances of those it
        looks up, then refresh all of them deepest first."""
        last = self._last
        fen = self._fen
        thr = self._threshold
        if look[0]:
            inv = 1.0 / self.rate
            for h, k, lk in zip(hs, ks, look):
                if not lk:
                    break
                if k > thr:
                    continue
                self._weight += inv
                t = last.get(h)
                if t is not None:
                    self._pending_d.append(fen.above(t) * inv)
                    self._pending_w.append(inv)
        if self._clock + len(hs) > fen.n:
            self._compact()
        last = self._last
        clock = self._clock
        grew = False
        for h, k in zip(reversed(hs), reversed(ks)):
            if k > self._threshold:
                continue
            t = last.get(h)
            if t is None:
                heapq.heappush(self._heap, (-k, h))
                grew = True
            else:
                fen.add(t, -1)
            last[h] = clock
            fen.add(clock, 1)
            clock += 1
        self._clock = clock
        if grew and len(last) > self.max_blocks:
            self._shrink()

    def _shrink(self) -> None:
        """Fixed-size SHARDS: drop the largest keys until max_blocks remain; lower T."""
        last = self._last
        while len(last) > self.max_blocks:
            negk, h = heapq.heappop(self._heap)
            self._fen.add(last.pop(h), -1)
            self._threshold = -negk - 1

    def _compact(self) -> None:
        """Renumber last-use times 0..n-1 in order so the Fenwick tree's times restart."""
        items = sorted(self._last.items(), key=lambda kv: kv[1])
        self._last = {h: i for i, (h, _) in enumerate(items)}
        self._fen.rebuild(np.arange(len(items), dtype=np.int64))
        self._clock = len(items)

    def _flush(self) -> None:
        if self._pending_d:
            d = np.asarray(self._pending_d)
            bins = np.where(d < _LINEAR, d, _LINEAR + np.log(np.maximum(d, _LINEAR) / _LINEAR) / _LOG_STEP)
            np.add.at(self._bins, np.minimum(bins.astype(np.int64), len(self._bins) - 1),
                      np.asarray(self._pending_w))
            self._pending_d.clear()
            self._pending_w.clear()

    def hit_blocks(self, sizes: Sequence[float] | np.ndarray) -> np.ndarray:
        """Estimated lookup blocks found cached at each cache size (blocks)."""
        self._flush()
        cum = np.concatenate([[0.0], np.cumsum(self._bins)])
        upper = np.array([_bin_upper(float(c)) for c in np.asarray(sizes, dtype=np.float64)], dtype=np.int64)
        hits = cum[np.minimum(upper, len(self._bins))]
        if self.adjust and self._weight > 0:
            # SHARDS-adj: the references the sample over- or under-represents are
            # credited at the smallest distance (where the hottest blocks are).
            hits = hits + np.where(upper > 0, self.blocks - self._weight, 0.0)
        return np.clip(hits, 0.0, float(self.blocks))

    def curve(self, sizes: Sequence[float] | np.ndarray) -> Curve:
        """The estimated hit rate (cached input tokens / input tokens) at each size."""
        sizes = np.asarray(sizes, dtype=np.int64)
        hits = self.hit_blocks(sizes) * self.block_tokens
        rate = hits / self.input_tokens if self.input_tokens else np.zeros(len(sizes))
        return Curve(sizes, np.minimum(rate, 1.0), self.block_tokens, self.rate, self.tracked,
                     self.input_tokens, self.lookups, self.blocks)


def default_sizes(max_blocks: int, points: int = 48) -> np.ndarray:
    """Cache sizes from 1 block to max_blocks, spaced evenly on a log scale (distinct)."""
    top = max(1, int(max_blocks))
    return np.unique(np.rint(np.geomspace(1, top, points)).astype(np.int64))


def default_rate(blocks: int, budget: int = 300_000) -> float:
    """A sampling rate that tracks about `budget` references of a stream of `blocks`: exact
    for streams of up to `budget` blocks, a rate of 0.03 at 10M blocks."""
    return 1.0 if blocks <= budget else budget / blocks


def estimate(stream: BlockStream, sizes: Sequence[float] | np.ndarray | None = None, *,
             rate: float | None = None, max_blocks: int = 65_536, adjust: bool = True) -> Curve:
    """The pooled cache's curve for a stream (rate None: default_rate)."""
    lookup_blocks = int(stream.looked_up().sum())
    est = Shards(stream.block_tokens, rate=rate or default_rate(len(stream.hashes)),
                 max_blocks=max_blocks, adjust=adjust).feed(stream)
    if sizes is None:
        distinct = len(np.unique(stream.hashes)) if len(stream.hashes) <= 20_000_000 else lookup_blocks
        sizes = default_sizes(max(distinct, 1))
    return est.curve(sizes)


def per_replica(stream: BlockStream, sizes: Sequence[float] | np.ndarray, *, rate: float | None = None,
                max_blocks: int = 65_536) -> dict[int, Curve]:
    """One curve per replica of a stream whose operations carry replicas (each replica's
    cache sees only its own operations)."""
    if stream.replica is None:
        raise ValueError("the stream has no replica per operation")
    out = {}
    for r in np.unique(stream.replica):
        if r < 0:
            continue
        sel = np.flatnonzero(stream.replica == r)
        sub = _select(stream, sel)
        out[int(r)] = Shards(stream.block_tokens, rate=rate or default_rate(len(sub.hashes)),
                             max_blocks=max_blocks).feed(sub).curve(sizes)
    return out


def fleet_hit_rate(curves: dict[int, Curve], sizes: Sequence[float] | np.ndarray) -> np.ndarray:
    """The fleet's hit rate when every replica has a cache of each size (blocks)."""
    hit = np.zeros(len(np.asarray(sizes)))
    total = 0
    for c in curves.values():
        hit += c.hit_rate * c.input_tokens
        total += c.input_tokens
    return hit / total if total else hit


def _select(stream: BlockStream, ops: np.ndarray) -> BlockStream:
    from .stream import build

    looked = stream.looked_up()
    return build([(stream.blocks(int(i)), int(stream.prompt_tokens[i]), bool(stream.counted[i])) for i in ops],
                 stream.block_tokens, lookup_blocks=looked[ops])


def exact_hit_rate(stream: BlockStream, sizes: Sequence[int] | np.ndarray, impl: Any = None) -> np.ndarray:
    """The oracle: replay the stream on a kvroute PrefixIndex(capacity=C) per size (the
    simulator's cache) and measure cached input tokens / input tokens exactly."""
    from .._backend import backend

    mod = impl or backend
    out = []
    bt = stream.block_tokens
    total = stream.input_tokens
    looked = stream.looked_up()
    for c in np.asarray(sizes, dtype=np.int64):
        index = mod.PrefixIndex(1, capacity=int(c))
        cached = 0
        for i in range(stream.num_ops):
            h = stream.blocks(i)
            if stream.counted[i]:
                cached += min(int(index.match(h[:looked[i]])[0]) * bt, int(stream.prompt_tokens[i]))
            if len(h):
                index.insert(0, h, 0.0)
        out.append(cached / total if total else 0.0)
    return np.array(out)


__all__ = ["Curve", "Shards", "default_rate", "default_sizes", "estimate", "exact_hit_rate", "fleet_hit_rate",
           "per_replica", "sample_keys"]
