"""From an OpenAI request body to what routing needs: token ids the engine will agree with,
the session, and the per-request cache keys (LoRA adapter, cache_salt, multimodal items).

- Chat: the chat template renders `messages` (with `tools`, `add_generation_prompt`, default
  true, and `chat_template_kwargs`, as vLLM passes them) and the text is tokenized without
  tokenizer-added special tokens; per session only the new part (kvroute.tokenize.incremental).
- Completions: a string prompt is tokenized with the tokenizer's special tokens (vLLM's
  add_special_tokens default for completions); token ids are used as given; a batch is
  routed by its first prompt (one replica serves the whole request).
- LoRA: the model name when it is a LoRA adapter (--lora-models, or a /v1/models entry with
  a "parent"). cache_salt: the body's (vLLM). Multimodal parts (image_url, input_audio,
  video_url) are keyed by their URL/data at offset 0: the gateway cannot know where the
  engine's processor places them, so such prompts match only each other (under-claims).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import xxhash

from ..tokenize import IncrementalEncoder, Tokenizer

_MM_TYPES = {"image_url": "url", "input_audio": "data", "video_url": "url", "audio_url": "url"}


class BadRequest(ValueError):
    """A 400: the message names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(slots=True)
class Prompt:
    """What route() takes for one request."""

    tokens: Any
    session: str | None
    lora: str | None
    cache_salt: str | None
    mm: list[tuple[str, int, int]] | None
    stream: bool


def _mm_items(messages: list[Any]) -> list[str]:
    ids = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in _MM_TYPES:
                value = part.get(part["type"])
                ref = value.get(_MM_TYPES[part["type"]]) if isinstance(value, Mapping) else value
                ids.append(xxhash.xxh3_64_hexdigest(str(ref).encode()))
    return ids


def keys(body: Mapping[str, Any], lora_models: set[str] | frozenset[str]) -> tuple[str | None, str | None]:
    """(lora, cache_salt) of a request body."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("cache_salt must be a string", "cache_salt")
    return (model if model in lora_models else None), salt


def chat_request(body: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """(messages, template kwargs) of a chat body, validated."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise BadRequest("tools must be an array of objects", "tools")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise BadRequest("add_generation_prompt must be a boolean", "add_generation_prompt")
    return messages, {"add_generation_prompt": gen, "tools": tools, **extra}


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The (first) prompt of a completions body: text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < 2**32 for t in prompt):
        return prompt
    raise BadRequest("prompt must be a string, an array of token ids (0 <= id < 2**32) or a batch of them", "prompt")


def session_of(body: Mapping[str, Any], header: str | None) -> str | None:
    """The session: the header, else the body's `user`."""
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) and user else None


class LocalTokens:
    """Token ids from the gateway's own tokenizer (built-in or Hugging Face)."""

    def __init__(self, tokenizer: Tokenizer, max_sessions: int) -> None:
        self.tokenizer = tokenizer
        self.encoder = IncrementalEncoder(tokenizer, max_sessions=max_sessions)

    def chat(self, body: Mapping[str, Any], session: str | None) -> Any:
        """Ids of a chat request (incremental per session)."""
        messages, kwargs = chat_request(body)
        try:
            return self.encoder.encode_chat(session, messages, **kwargs)
        except BadRequest:
            raise
        except (ValueError, TypeError) as e:
            raise BadRequest(f"messages: {e}", "messages") from e
        except Exception as e:  # a template's raise_exception() and jinja errors: the client's input
            if type(e).__module__.startswith("jinja2"):
                raise BadRequest(f"chat template: {e}", "messages") from e
            raise

    def completion(self, body: Mapping[str, Any]) -> Any:
        """Ids of a completions request."""
        prompt = completion_prompt(body)
        return self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt


def build_prompt(body: Any, kind: str, tokens: Any, session: str | None,
                 lora_models: set[str] | frozenset[str]) -> Prompt:
    """A Prompt from a validated body and its ids."""
    lora, salt = keys(body, lora_models)
    mm = None
    if kind == "chat":
        ids = _mm_items(body["messages"])
        mm = [(i, 0, 1) for i in ids] or None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    return Prompt(tokens, session, lora, salt, mm, stream)
