"""Incremental per-session tokenization: a conversation's next turn re-renders the whole chat,
but its text extends the previous turn's up to (at least) the last message, so only the text
after the last special token the two share needs tokenizing.

Correctness: both tokenizers kvroute supports split a text at special tokens before anything
else (kvroute.tokenize.base), so for a position `b` where a special token starts,
ids(text) == ids(text[:b]) + ids(text[b:]). The cache keeps each session's previous text,
its ids and the (char, token index) of every special-token start; the next text reuses the
ids before the last such start that both texts share and tokenizes the rest. When the start
positions cannot be paired with the ids the entry is not reused (full tokenization).

Bounded: at most `max_sessions` sessions (least recently used dropped first), each holding
one text and its ids.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .base import Tokenizer


@dataclasses.dataclass
class _Entry:
    text: str
    ids: np.ndarray
    chars: list[int]
    ends: list[int]
    toks: list[int]


@dataclasses.dataclass
class IncrementalStats:
    """Counters: calls with a reusable entry (hits) or without (misses), tokens reused and
    tokens tokenized."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    encoded_tokens: int = 0


class IncrementalEncoder:
    """Session-cached encoding of rendered prompts; results equal `tokenizer.encode(text)`.

    encode(session, text) -> np.ndarray[int32]; session None tokenizes in full and caches nothing.
    """

    def __init__(self, tokenizer: Tokenizer, max_sessions: int = 4096) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.stats = IncrementalStats()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def encode_chat(self, session: str | None, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                    **kwargs: Any) -> np.ndarray:
        """Render `messages` and encode them for `session`."""
        text = self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(session, text)

    def encode(self, session: str | None, text: str) -> np.ndarray:
        """Ids of `text` (no tokenizer-added special tokens), reusing `session`'s previous ids."""
        if session is None:
            ids = self.tokenizer.encode_array(text)
            self.stats.misses += 1
            self.stats.encoded_tokens += len(ids)
            return ids
        entry = self._cache.get(session)
        split = self._shared_boundary(entry, text) if entry is not None else -1
        if entry is None or split < 0:
            self.stats.misses += 1
            new = self._full(text)
        else:
            self.stats.hits += 1
            new = self._extend(entry, split, text)
        self._store(session, new)
        return new.ids

    def forget(self, session: str) -> None:
        """Drop a session's entry."""
        self._cache.pop(session, None)

    def _full(self, text: str) -> _Entry:
        ids = self.tokenizer.encode_array(text)
        self.stats.encoded_tokens += len(ids)
        bounds = self.tokenizer.boundaries(text, ids)
        if bounds is None:
            return _Entry(text, ids, [], [], [])
        return _Entry(text, ids, *bounds)

    @staticmethod
    def _shared_boundary(entry: _Entry, text: str) -> int:
        """Index of the last boundary of `entry` before which `text` equals entry.text, or -1."""
        chars = entry.chars
        if not chars:
            return -1
        if text.startswith(entry.text):
            return len(chars) - 1
        # The split must start a special token in both texts: text extends entry.text through
        # the end of boundary j's token. That holds for a prefix of j: bisect on it.
        lo, hi = 0, len(chars)
        while lo < hi:
            mid = (lo + hi) // 2
            if text.startswith(entry.text[:entry.ends[mid]]):
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def _extend(self, entry: _Entry, j: int, text: str) -> _Entry:
        b, k = entry.chars[j], entry.toks[j]
        suffix = text[b:]
        sids = self.tokenizer.encode_array(suffix)
        bounds = self.tokenizer.boundaries(suffix, sids)
        if bounds is None:
            return self._full(text)
        self.stats.reused_tokens += k
        self.stats.encoded_tokens += len(sids)
        ids = np.concatenate((entry.ids[:k], sids))
        chars = entry.chars[:j] + [b + c for c in bounds[0]]
        ends = entry.ends[:j] + [b + c for c in bounds[1]]
        toks = entry.toks[:j] + [k + t for t in bounds[2]]
        return _Entry(text, ids, chars, ends, toks)

    def _store(self, session: str, entry: _Entry) -> None:
        self._cache[session] = entry
        self._cache.move_to_end(session)
        while len(self._cache) > self.max_sessions:
            self._cache.popitem(last=False)


__all__ = ["IncrementalEncoder", "IncrementalStats"]
