"""The tokenizer interface every kvroute tokenizer implements, and its special-token boundaries.

A boundary is the start of a special token in a text: the tokenizers kvroute supports split a
text at special tokens before anything else (Hugging Face `tokenizers` extracts added special
tokens first and runs normalizer, pre-tokenizer and model on each piece between them), so
`encode(text) == encode(text[:b]) + encode(text[b:])` for every boundary `b`. Incremental
tokenization (kvroute.tokenize.incremental) reuses a session's previous ids up to such a point.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class Tokenizer(ABC):
    """Text <-> token ids plus a chat template (contract C4).

    Subclasses implement `encode`, `decode` and `render_chat`; `encode_chat` renders and
    encodes without special tokens added by the tokenizer (the template writes them), which
    is what vLLM and transformers' `apply_chat_template` do.
    """

    name: str = "tokenizer"

    def __init__(self, boundary_tokens: Sequence[str], boundary_ids: Sequence[int]) -> None:
        # Longest first so alternation picks the longest special token at a position, as the
        # tokenizers' leftmost-longest matcher does.
        ordered = sorted(set(boundary_tokens), key=len, reverse=True)
        self._boundary_re = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None
        self._boundary_ids = np.array(sorted(set(boundary_ids)), dtype=np.int64)
        self._boundary_tokens = ordered
        self.incremental_safe = True

    def check_boundaries(self) -> bool:
        """Probe the split property at every special token; when one fails (e.g. a
        sentencepiece Metaspace pre-tokenizer that prepends to a text's first piece only),
        give up boundaries so incremental tokenization always tokenizes in full."""
        heads = ("", "a", "Hello world.", "x \n ", " \t")
        tails = ("", "user\nhi there", " a b\nc", "\n\nHello world.", "汉 🙂 x")
        for token in self._boundary_tokens:
            for head in heads:
                for tail in tails:
                    whole = self.encode(head + token + tail)
                    if whole != self.encode(head) + self.encode(token + tail):
                        self._boundary_re = None
                        self.incremental_safe = False
                        return False
        return True

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds
        (e.g. BOS) the way a completions endpoint does."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""

    @abstractmethod
    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text the chat template makes of `messages`."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included)."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as an int32 array (what routing hashes); subclasses may do it faster."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (no tokenizer-added special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                            tools=tools, **kwargs))

    def boundaries(self, text: str, ids: Sequence[int] | np.ndarray) -> tuple[list[int], list[int], list[int]] | None:
        """(starts, ends, token indices) of the special tokens in `text`, or None when they
        cannot be paired up with `ids` (then nothing may be reused)."""
        if not self.incremental_safe:
            return None
        if self._boundary_re is None:
            return [], [], []
        spans = [m.span() for m in self._boundary_re.finditer(text)]
        arr = np.asarray(ids, dtype=np.int64)
        toks = np.flatnonzero(np.isin(arr, self._boundary_ids)).tolist() if spans else []
        if len(toks) != len(spans):
            return None
        return [s for s, _ in spans], [e for _, e in spans], toks
