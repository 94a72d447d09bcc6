"""The emulated model's answer: a fixed token sequence, the same for every request.

Every request generates the first max_tokens ids of one cycle of FILLER_TEXT as the
tokenizer encodes it, and streams their decoded text. Equal prompts therefore produce
equal answers (as greedy decoding would), the engine model caches the answer's blocks
under the ids it really generated, and a client that sends the answer back in its next
turn (a chat history) re-tokenizes it to those same ids (exactly with the built-in
byte-level tokenizer; a BPE tokenizer can merge differently only where the cycle wraps),
so the next turn hits the answer's blocks as it would on vLLM.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FILLER_TEXT = (" The emulated engine answers with this filler text, one token per scheduler step, at the times"
               " its model of the GPU says each step ends; the words carry no meaning, only their count and"
               " timing do, and every request receives the same ones in the same order.")
_CYCLE_TOKENS = 4096


class Filler:
    """Output ids and their text for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        ids: list[int] = []
        while len(ids) < _CYCLE_TOKENS:
            ids += tokenizer.encode(FILLER_TEXT)
        self.ids = np.asarray(ids, dtype=np.int64)
        self._tokenizer = tokenizer

    def output(self, max_tokens: int) -> np.ndarray:
        """The ids a request of max_tokens generates."""
        n = self.ids.size
        if max_tokens <= n:
            return self.ids[:max_tokens]
        return np.take(self.ids, np.arange(max_tokens) % n)

    def text(self, start: int, count: int) -> str:
        """The text of output tokens start .. start+count-1."""
        if count <= 0:
            return ""
        n = self.ids.size
        ids = self.ids[start:start + count] if start + count <= n else np.take(self.ids, np.arange(start, start + count) % n)
        return self._tokenizer.decode(ids.tolist())


__all__ = ["FILLER_TEXT", "Filler"]
