"""Tokenization for routing (contract C4): token ids the engine will agree with.

    tok = load_tokenizer(None)            # built-in byte-level tokenizer, ChatML-like template
    tok = load_tokenizer("/models/qwen")  # tokenizer.json + chat template (`tokenizers`, `jinja2`)
    ids = tok.encode_chat(messages)       # == transformers' apply_chat_template(messages, add_generation_prompt=True)
    enc = IncrementalEncoder(tok)         # per-session cache: only a turn's new text is tokenized
    ids = enc.encode_chat("session-1", messages)

Hugging Face mode needs the `tokenizers` and `jinja2` packages (the `gateway` extra); the
built-in tokenizer needs nothing.
"""

from __future__ import annotations

from .base import Tokenizer
from .byte import SPECIAL_TOKENS, ByteTokenizer
from .incremental import IncrementalEncoder, IncrementalStats


def load_tokenizer(path: str | None) -> Tokenizer:
    """The built-in tokenizer for None, else the Hugging Face tokenizer in `path` (a folder
    with tokenizer.json, or the tokenizer.json file)."""
    if path is None:
        return ByteTokenizer()
    if not isinstance(path, str):
        raise TypeError(f"path must be a str or None, not {type(path).__name__}")
    from .hf import HFTokenizer

    return HFTokenizer(path)


__all__ = ["Tokenizer", "ByteTokenizer", "SPECIAL_TOKENS", "IncrementalEncoder", "IncrementalStats", "load_tokenizer"]
