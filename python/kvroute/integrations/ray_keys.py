"""What kvroute routes on, taken from a Ray Serve request (no Ray import here).

Ray Serve hands a request router a `PendingRequest` whose `args`/`kwargs` are what the
caller passed to the deployment handle; Ray Serve LLM passes a request object with a
`messages` (chat) or `prompt` (completion) attribute, which Ray's own
`PrefixCacheAffinityRouter` reads the same way
(ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py,
`_extract_text_from_request`). We look, in order, at each positional argument and then
the keyword arguments, for an object attribute or a mapping key:

- `prompt_token_ids` / `token_ids` (a list of ints): routed as token ids;
- `messages` (chat) or `prompt` (str, or a list of ints = token ids).

Keys (`PromptKey`):
- **tokens** when the request carries token ids, or when a tokenizer is configured (the
  text is tokenized with kvroute.tokenize, chat messages with the tokenizer's template);
- **text** otherwise: tokenizer-free. The rendered prompt (chat messages rendered with the
  built-in ChatML-like template of kvroute.tokenize's byte tokenizer) is routed as its
  UTF-8 bytes, one byte = one "token", in blocks of `text_block_bytes`. This is
  approximate, like SGLang's character radix tree and Ray's character prefix tree: two
  prompts share a block only if their first k*text_block_bytes bytes are equal, which is a
  sufficient (not a necessary) condition for their token prefixes to agree, so the
  router may under-claim a shared prefix but never over-claims one at block granularity
  (a tokenizer merging across the block edge can differ in the engine's last token).
- **none** when the request carries none of these (routing then falls back to kvroute's
  load-only view: an empty prompt).

Sessions: Ray's own `RequestMetadata.session_id` (set by the `x-session-id` HTTP header or
`handle.options(session_id=...)`) wins; else the field named by `session_key` on the
request (attribute or mapping key, e.g. "user"). Multiplexed model ids (LoRA adapters)
become the `lora` cache key so adapters never share affinity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..tokenize import Tokenizer, load_tokenizer

#: Fields that carry token ids, in the order they are looked for.
TOKEN_FIELDS = ("prompt_token_ids", "token_ids")
#: Fields that carry text: chat messages, then a completion prompt.
TEXT_FIELDS = ("messages", "prompt")


@dataclass(frozen=True)
class PromptKey:
    """A request's routing key: kind "tokens", "text" or "none"; `ids` are uint32 token
    ids (text mode: the UTF-8 bytes of the rendered prompt)."""

    kind: str
    ids: np.ndarray


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _as_ids(value: Any) -> np.ndarray | None:
    """Token ids when `value` is a non-string sequence of ints, else None."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return value.astype(np.uint32, copy=False)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    ):
        return np.asarray(value, dtype=np.uint32) if value else np.zeros(0, np.uint32)
    return None


def request_objects(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The objects a request's fields are looked up on: each positional argument, then the
    keyword arguments as one mapping."""
    objs = list(args or ())
    if kwargs:
        objs.append(dict(kwargs))
    return objs


class KeyExtractor:
    """Turns a request's payload into a PromptKey and a session id.

    tokenizer: a kvroute.tokenize tokenizer path (Hugging Face folder or tokenizer.json),
    "builtin" for the byte-level tokenizer, or None for the tokenizer-free text mode.
    session_key: the request field holding a session id, or None.
    """

    def __init__(self, tokenizer: str | None = None, session_key: str | None = None) -> None:
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise TypeError(f"tokenizer must be a str or None, got {type(tokenizer).__name__}")
        if session_key is not None and not isinstance(session_key, str):
            raise TypeError(f"session_key must be a str or None, got {type(session_key).__name__}")
        self._tok: Tokenizer | None = None
        if tokenizer is not None:
            self._tok = load_tokenizer(None if tokenizer == "builtin" else tokenizer)
        # Text mode renders chat messages with the built-in template (no download, no
        # vocabulary): what matters is that equal conversations render to equal bytes.
        self._renderer = load_tokenizer(None)
        self._session_key = session_key

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> PromptKey:
        """The routing key of a request given its handle call's args and kwargs."""
        objs = request_objects(args, kwargs)
        for obj in objs:
            for name in TOKEN_FIELDS:
                ids = _as_ids(_field(obj, name))
                if ids is not None:
                    return PromptKey("tokens", ids)
        for obj in objs:
            for name in TEXT_FIELDS:
                value = _field(obj, name)
                if value is None:
                    continue
                ids = _as_ids(value) if name == "prompt" else None
                if ids is not None:
                    return PromptKey("tokens", ids)
                return self._from_text(name, value)
        return PromptKey("none", np.zeros(0, np.uint32))

    def _from_text(self, name: str, value: Any) -> PromptKey:
        if name == "messages":
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"messages must be a list, got {type(value).__name__}")
            msgs = [m if isinstance(m, Mapping) else _message_dict(m) for m in value]
            if self._tok is not None:
                return PromptKey("tokens", np.asarray(self._tok.encode_chat(msgs), dtype=np.uint32))
            text = self._renderer.render_chat(msgs)
        else:
            if not isinstance(value, str):
                raise TypeError(f"prompt must be a str or a list of token ids, got {type(value).__name__}")
            if self._tok is not None:
                return PromptKey("tokens", self._tok.encode_array(value).astype(np.uint32))
            text = value
        return PromptKey("text", np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32))

    def session(self, metadata_session: str | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """Ray's session id when set, else the request's `session_key` field (as a str)."""
        if metadata_session:
            return str(metadata_session)
        if self._session_key is None:
            return None
        for obj in request_objects(args, kwargs):
            value = _field(obj, self._session_key)
            if value is not None and value != "":
                return str(value)
        return None


def _message_dict(message: Any) -> dict[str, Any]:
    """A chat message object (pydantic model or similar) as the dict templates take."""
    if hasattr(message, "model_dump"):
        return dict(message.model_dump())
    return {"role": getattr(message, "role", "user"), "content": getattr(message, "content", "")}
