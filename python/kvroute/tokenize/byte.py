"""The built-in tokenizer: one id per UTF-8 byte plus a few special tokens, and a ChatML-like
template. Needs nothing but the standard library and numpy; no download.

Ids 0..255 are bytes; the special tokens follow (SPECIAL_TOKENS). The template writes every
message as `<|im_start|>{role}\\n{content}<|im_end|>\\n` (content given as a list of parts is
joined from its text parts; tools are written as a system block of JSON lines) and, with
add_generation_prompt, ends with `<|im_start|>assistant\\n`, the layout of Qwen's ChatML.
"""

from __future__ import annotations

import json
import re

import numpy as np
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens of the built-in tokenizer, ids 256, 257, 258."""


def message_text(content: Any) -> str:
    """A message's content as text: a string as is, a list of parts as its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise TypeError(f"message content must be a string or a list of parts, not {type(content).__name__}")


class ByteTokenizer(Tokenizer):
    """Byte-level ids (0..255) and SPECIAL_TOKENS (256..); ChatML-like chat template."""

    name = "builtin"

    def __init__(self) -> None:
        super().__init__(SPECIAL_TOKENS, range(256, 256 + len(SPECIAL_TOKENS)))
        self._special = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
        self._inverse = {i: t.encode() for t, i in self._special.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
        self.eos_token_id = self._special["<|im_end|>"]

    @property
    def vocab_size(self) -> int:
        """256 bytes plus the special tokens."""
        return 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of `text`, special tokens as their ids (nothing is added)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._special[piece])
            elif piece:
                ids.extend(piece.encode())
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as int32, without a Python int per byte."""
        pieces = self._split.split(text)
        if len(pieces) == 1:
            return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
        parts = []
        for i, piece in enumerate(pieces):
            if i % 2:
                parts.append(np.array([self._special[piece]], dtype=np.int32))
            elif piece:
                parts.append(np.frombuffer(piece.encode(), dtype=np.uint8).astype(np.int32))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 is replaced."""
        out = bytearray()
        for t in ids:
            t = int(t)
            if 0 <= t < 256:
                out.append(t)
            elif t in self._inverse:
                out += self._inverse[t]
            else:
                raise ValueError(f"ids: {t} is not a token id of the built-in tokenizer (0..{self.vocab_size - 1})")
        return out.decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """ChatML-like prompt text of `messages`."""
        parts = []
        if tools:
            lines = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
            parts.append(f"<|im_start|>system\n# Tools\n{lines}<|im_end|>\n")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            parts.append(f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
