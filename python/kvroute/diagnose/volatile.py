"""The volatile-prefix detector: long stretches that repeat under different leading blocks.

The seed's failure mode: "hit rate is near zero even though the system prompt is
identical: something volatile sits at the top of the prompt: a timestamp, a request id, a
user name, or a tool list serialized in non-deterministic order". Block hashes are
chained, so one changed token near the top changes every later hash; the prefix cache
misses the whole prompt although most of its text was seen before. Chained hashes cannot
show this; tokens can.

How (bounded work per prompt, bounded memory):

1. Content-defined anchors. Each token id is mixed to 64 bits; the sum over a window of
   `window` tokens rolls in O(1) per position (numpy cumsum). A window is an anchor
   where the mixed sum falls under 2**64 / anchor_every, so the same text has the same
   anchors wherever it sits: a header of a different length does not hide the repeat.
   An anchor's fingerprint adds a position-weighted sum, so reordered text differs.
2. A bounded table of fingerprints (spatial sampling as in SHARDS: only fingerprints
   under a threshold are kept, at most max_entries; when full, the largest leaves and
   the threshold drops, so a repeated window is always sampled the same way). An entry
   remembers where it was first seen: the prompt, the anchor's offset, the chained hash
   of the block holding the window's end, and the prompt's first `prefix_tokens` tokens.
3. A later anchor with a known fingerprint is ordinary prefix reuse when its window ends
   in the same block under the same chained hash (the cache serves it). Otherwise the
   text repeats but the cache cannot serve it: the prompts diverge at the first token
   where their leading tokens differ. If that divergence is within max_offset tokens
   of the top, it is a volatile prefix.
4. Tokens lost, per prompt: from the block holding the divergence to the end of the last
   such repeated window in an unbroken run of them (sampled anchors that are new text
   end the run), only within full blocks. Under-claimed: text between the last anchor
   and a run's true end is not counted.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x * _M1
        x ^= x >> np.uint64(31)
        x = x * _M2
        x ^= x >> np.uint64(29)
    return x


@dataclass
class _Entry:
    prompt: int
    offset: int
    block: int
    chain: int
    prefix: np.ndarray


@dataclass(frozen=True)
class Divergence:
    """One prompt whose text repeats an earlier prompt's after a diverging top.

    prompt: its index (order observed). earlier: the index of the prompt whose text it
    repeats. offset: the first token at which the two differ. lost_tokens: tokens of
    repeated text the prefix cache could not serve. text / earlier_text: decoded tokens
    around the offset (with a decode function), else the token ids as text.
    """

    prompt: int
    earlier: int
    offset: int
    lost_tokens: int
    text: str = ""
    earlier_text: str = ""


@dataclass
class VolatileReport:
    """What the detector found: prompts with a volatile prefix, tokens lost, offsets."""

    prompts: int
    input_tokens: int
    affected_prompts: int
    lost_tokens: int
    offsets: list[tuple[int, int]] = field(default_factory=list)
    samples: list[Divergence] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """Whether any prompt lost cache to a volatile prefix."""
        return self.affected_prompts > 0

    @property
    def lost_fraction(self) -> float:
        """Lost tokens / input tokens."""
        return self.lost_tokens / self.input_tokens if self.input_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {"found": self.found, "prompts": self.prompts, "input_tokens": self.input_tokens,
                "affected_prompts": self.affected_prompts, "lost_tokens": self.lost_tokens,
                "lost_fraction": round(self.lost_fraction, 6),
                "divergence_offsets": [{"offset": o, "prompts": n} for o, n in self.offsets],
                "samples": [s.__dict__ for s in self.samples]}


class VolatilePrefixDetector:
    """Feed prompts in time order with observe(); read report().

    block_size: the cache's block size in tokens (for the chained hashes and what the
    cache could serve). window: tokens per anchored window (32). anchor_every: one anchor
    per this many tokens on average (32). max_offset: a divergence further into the
    prompt than this is not a volatile *prefix* (512 tokens). max_entries: table bound
    (16,384). Memory: each entry ~100 B plus, shared by all the entries of one prompt, that
    prompt's first max_offset + 32 token ids as uint32 (2.2 KB): at most ~38 MB, far less
    when prompts hold many anchors each. max_samples: divergences kept for the report.
    """

    def __init__(self, block_size: int = 16, *, window: int = 32, anchor_every: int = 32,
                 max_offset: int = 512, max_entries: int = 16_384, max_samples: int = 5) -> None:
        for name, value, low in (("block_size", block_size, 1), ("window", window, 1),
                                 ("anchor_every", anchor_every, 1), ("max_offset", max_offset, 1),
                                 ("max_entries", max_entries, 1), ("max_samples", max_samples, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.block_size = int(block_size)
        self.window = int(window)
        self.max_offset = int(max_offset)
        self.max_entries = int(max_entries)
        self.max_samples = int(max_samples)
        self._anchor_thr = np.uint64(_MASK // int(anchor_every))
        self._table_thr = _MASK
        self._table: dict[int, _Entry] = {}
        self._heap: list[int] = []  # negated fingerprints: the largest on top
        self._prefix_tokens = self.max_offset + 32
        self._prompts = 0
        self._input_tokens = 0
        self._affected = 0
        self._lost = 0
        self._offsets: Counter[int] = Counter()
        self._samples: list[tuple[Divergence, np.ndarray, np.ndarray]] = []

    def anchors(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, fingerprints) of the prompt's anchored windows, in offset order."""
        w = self.window
        n = len(tokens)
        if n < w:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64)
        v = _mix(np.asarray(tokens, dtype=np.uint64) + np.uint64(1))
        with np.errstate(over="ignore"):
            s = np.concatenate([[np.uint64(0)], np.cumsum(v, dtype=np.uint64)])
            pos = np.arange(n, dtype=np.uint64)
            t = np.concatenate([[np.uint64(0)], np.cumsum(v * pos, dtype=np.uint64)])
            win = s[w:] - s[:-w]
            at = np.flatnonzero(_mix(win) <= self._anchor_thr)
            # Position-weighted sum relative to the window start: order-sensitive.
            weighted = (t[at + w] - t[at]) - np.arange(n, dtype=np.uint64)[at] * win[at]
            fp = _mix(win[at] ^ _mix(weighted))
        return at.astype(np.int64), fp

    def observe(self, tokens: Any, hashes: np.ndarray | None = None) -> Divergence | None:
        """One prompt (token ids); hashes: its chained block hashes at block_size (computed
        with kvroute.block_hashes when None). Returns the prompt's divergence, if any."""
        toks = np.asarray(tokens, dtype=np.int64)
        if toks.ndim != 1:
            raise ValueError("tokens must be a flat sequence of token ids")
        if hashes is None:
            from .._backend import backend

            hashes = backend.block_hashes(toks, self.block_size)
        idx = self._prompts
        self._prompts += 1
        self._input_tokens += len(toks)
        bs = self.block_size
        full = len(hashes) * bs
        at, fp = self.anchors(toks)
        keep = (at + self.window <= full) & (fp <= np.uint64(self._table_thr))
        at, fp = at[keep], fp[keep]
        found: Divergence | None = None
        run_end = -1
        run_open = True
        head = toks[: self._prefix_tokens].astype(np.uint32)  # shared by this prompt's entries
        diffs: dict[int, int] = {}  # earlier prompt -> where head first differs from its prefix
        for off, f in zip(at.tolist(), fp.tolist()):
            if f > self._table_thr:
                continue
            block = (off + self.window - 1) // bs
            chain = int(hashes[block])
            e = self._table.get(f)
            if e is None:
                run_open = found is None  # new text ends the repeated run
                self._insert(f, _Entry(idx, off, block, chain, head))
                continue
            if e.block == block and e.chain == chain or not run_open:
                continue  # ordinary prefix reuse, or past the run
            if found is None:
                div = diffs.get(e.prompt)
                if div is None:  # the same for every entry of that prompt: they share its prefix
                    div = diffs[e.prompt] = _first_difference(head, e.prefix)
                if div >= min(off, self.max_offset):
                    continue  # diverges too deep to be a prefix (or not before this window)
                found = Divergence(idx, e.prompt, div, 0)
                sample = (head[max(0, div - 48): div + 48].copy(), e.prefix[max(0, div - 48): div + 48].copy())
            run_end = off + self.window
        if found is None:
            return None
        lost = max(0, min(run_end, full) - found.offset // bs * bs)
        found = Divergence(found.prompt, found.earlier, found.offset, lost)
        self._affected += 1
        self._lost += lost
        self._offsets[found.offset] += 1
        if len(self._samples) < self.max_samples:
            self._samples.append((found, *sample))
        return found

    def _insert(self, f: int, entry: _Entry) -> None:
        self._table[f] = entry
        heapq.heappush(self._heap, -f)
        while len(self._table) > self.max_entries:
            top = -heapq.heappop(self._heap)
            del self._table[top]
            self._table_thr = top - 1

    def report(self, decode: Callable[[list[int]], str] | None = None, top_offsets: int = 5) -> VolatileReport:
        """The findings so far; decode (token ids -> text) renders the samples' context."""
        show = decode or (lambda ids: " ".join(map(str, ids)))
        samples = []
        for d, mine, theirs in self._samples:
            lo = max(0, d.offset - 48)
            samples.append(Divergence(d.prompt, d.earlier, d.offset, d.lost_tokens,
                                      _context(show, mine, d.offset - lo), _context(show, theirs, d.offset - lo)))
        return VolatileReport(self._prompts, self._input_tokens, self._affected, self._lost,
                              self._offsets.most_common(top_offsets), samples)


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _context(show: Callable[[list[int]], str], ids: np.ndarray, at: int, before: int = 24, after: int = 24) -> str:
    """Text around position `at` of ids, the divergence marked with '⟨' ."""
    ids_l = [int(x) for x in ids]
    lo = max(0, at - before)
    try:
        return show(ids_l[lo:at]) + "⟨" + show(ids_l[at: at + after])
    except Exception:  # a tokenizer may refuse a cut through a multi-token character
        return " ".join(map(str, ids_l[lo:at])) + " ⟨ " + " ".join(map(str, ids_l[at: at + after]))


__all__ = ["Divergence", "VolatilePrefixDetector", "VolatileReport"]
