"""Hugging Face tokenizers: tokenizer.json through `tokenizers`, the chat template from the same
folder (chat_template.jinja, chat_template.json or tokenizer_config.json's "chat_template", in
the order transformers v5 reads them), special tokens from tokenizer_config.json (then
special_tokens_map.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Tokenizer
from .template import ChatTemplate

NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens chat templates see (transformers' SPECIAL_TOKENS_ATTRIBUTES)."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _chat_template(folder: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template",
                                                                          config.get("chat_template"))
    if isinstance(template, list):
        return {str(t["name"]): str(t["template"]) for t in template}
    return template if isinstance(template, (str, dict)) else None


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (tokenizer.json) with its chat template.

    Boundaries for incremental tokenization are the special added tokens that are matched
    in raw text (normalized=false) and do not strip whitespace to their left (lstrip=false):
    both halves of a text split at one tokenize to exactly the pieces of the whole.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ValueError(f"tokenizer: {file} does not exist (give a folder with tokenizer.json, "
                             f"the file itself, or leave it unset for the built-in tokenizer)")
        self._tok = RustTokenizer.from_file(file)
        self.name = os.path.basename(os.path.normpath(folder)) or file
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))
        self.special_tokens = {k: t for k in NAMED_SPECIAL
                               if (t := _token_text(config.get(k, special_map.get(k)))) is not None}
        template = _chat_template(folder, config)
        self._template = ChatTemplate(template, self.special_tokens) if template is not None else None
        added = json.loads(self._tok.to_str()).get("added_tokens", [])
        safe = [a for a in added if a.get("special") and not a.get("normalized") and not a.get("lstrip")]
        super().__init__([a["content"] for a in safe], [a["id"] for a in safe])
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos is not None else None
        self.check_boundaries()

    @property
    def vocab_size(self) -> int:
        """Vocabulary size with added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        """Whether the folder holds a chat template."""
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text` (add_special_tokens runs the tokenizer's post-processor, e.g. BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The chat template's prompt text, as transformers' apply_chat_template(tokenize=False)."""
        if self._template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template (chat_template.jinja or "
                             f"tokenizer_config.json 'chat_template')")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
