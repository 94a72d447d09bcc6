"""vLLM's OpenAI-compatible request and response shapes, as plain dicts (msgspec JSON).

Followed from vLLM's vllm/entrypoints/openai/completion/serving.py and
chat_completion/serving.py (protocol.py for the field names):

- completion: {"id": "cmpl-...", "object": "text_completion", "created", "model",
  "choices": [{"index", "text", "logprobs": null, "finish_reason", "stop_reason": null}],
  "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
  "prompt_tokens_details": {"cached_tokens"}}}; streamed chunks have the same choices with
  the new text and `finish_reason` null until the last one; with
  `stream_options.include_usage` a last chunk with `"choices": []` carries the usage; then
  `data: [DONE]`.
- chat: "chat.completion" with `message: {"role": "assistant", "content"}`; streamed
  "chat.completion.chunk"s start with `delta: {"role": "assistant", "content": ""}`.
- `prompt_tokens_details.cached_tokens` is the engine's `num_cached_tokens` (the prefix
  hit at admission). vLLM adds it with `--enable-prompt-tokens-details`; the emulator
  always does.
- errors: {"error": {"message", "type", "param", "code"}} (vLLM's ErrorResponse since
  ErrorInfo, OpenAI's shape), 400 "BadRequestError" naming the field, 404
  "NotFoundError" for an unknown model.

Only single prompts and n=1 are emulated; `max_tokens` defaults to 16 on completions
(OpenAI's and vLLM's default); on chat, where vLLM generates until EOS or the context
limit, the emulated model "ends its answer" after DEFAULT_CHAT_TOKENS with
finish_reason "stop".
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 128
MAX_TOKEN_ID = (1 << 32) - 1
_json_decode = msgspec.json.Decoder().decode
json_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An error answered as an OpenAI error object: HTTP status, error type, offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind

    def body(self) -> bytes:
        """The OpenAI error object."""
        return json_encode({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                      "code": self.status}})


@dataclass
class GenRequest:
    """A validated completion or chat request."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    explicit_max: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        """vLLM's response id: cmpl-/chatcmpl- plus the request id."""
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError."""
    try:
        obj = _json_decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", None) from None
    if not isinstance(obj, dict):
        raise ApiError("the request body must be a JSON object", None)
    return obj


def _int(obj: dict[str, Any], key: str, default: int | None, low: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{key} must be an integer, got {type(value).__name__}", key)
    if value < low:
        raise ApiError(f"{key} must be >= {low}, got {value}", key)
    return value


def _bool(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be a boolean, got {type(value).__name__}", key)
    return value


def check_model(obj: dict[str, Any], served: str) -> str:
    """The request's model (absent: the served one); 404 for another model, as vLLM."""
    model = obj.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise ApiError(f"model must be a string, got {type(model).__name__}", "model")
    if model != served:
        raise ApiError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")
    return model


def token_ids(value: Any, key: str) -> list[int]:
    """A list of token ids, each in [0, 2**32) (kvroute's block hashing serializes uint32)."""
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ApiError(f"{key}[{i}] must be a token id in [0, 2**32), got {t!r}", key)
    return value


def prompt_ids(obj: dict[str, Any], tokenizer: Any) -> list[int]:
    """A completion prompt (text, token ids, or a batch of one) as token ids."""
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = token_ids(prompt, "prompt")
    elif prompt is None:
        raise ApiError("prompt is required", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("prompt: the emulator serves one prompt per request, not a batch", "prompt")
    else:
        raise ApiError("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise ApiError("prompt must not be empty", "prompt")
    return ids


def check_messages(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, each an object with a string role and string or parts content."""
    messages = obj.get("messages")
    if messages is None:
        raise ApiError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(f"messages[{i}].content must be a string or a list of parts", "messages")
    return messages


def _common(obj: dict[str, Any], chat: bool, served: str, ids: list[int], max_model_len: int) -> GenRequest:
    model = check_model(obj, served)
    if _int(obj, "n", 1, 1) != 1:
        raise ApiError("n: the emulator generates one choice per request", "n")
    key = "max_completion_tokens" if chat and obj.get("max_completion_tokens") is not None else "max_tokens"
    default = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    max_tokens = _int(obj, key, None, 1)
    explicit = max_tokens is not None
    if max_tokens is None:
        max_tokens = max(1, min(default, max_model_len - len(ids)))
    if len(ids) >= max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                         f"has {len(ids)} input tokens. Please reduce the length of the {'messages' if chat else 'prompt'}.",
                         "messages" if chat else "prompt")
    if len(ids) + max_tokens > max_model_len:
        raise ApiError(f"'{key}' is too large: {max_tokens}. This model's maximum context length is "
                         f"{max_model_len} tokens and your request has {len(ids)} input tokens "
                         f"({max_tokens} > {max_model_len} - {len(ids)}).", key)
    stream = _bool(obj, "stream")
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    opts = opts or {}
    for k in ("include_usage", "continuous_usage_stats"):
        if k in opts and opts[k] is not None and not isinstance(opts[k], bool):
            raise ApiError(f"stream_options.{k} must be a boolean", "stream_options")
    if opts and not stream:
        raise ApiError("stream_options: Stream options can only be defined when `stream=True`.", "stream_options")
    return GenRequest(chat, model, ids, max_tokens, explicit, stream, bool(opts.get("include_usage")),
                      bool(opts.get("continuous_usage_stats")))


def parse_completion(obj: dict[str, Any], served: str, tokenizer: Any, max_model_len: int) -> GenRequest:
    """A /v1/completions request, validated (ApiError names the field)."""
    if obj.get("echo"):
        raise ApiError("echo: not supported by the emulator", "echo")
    return _common(obj, False, served, prompt_ids(obj, tokenizer), max_model_len)


def parse_chat(obj: dict[str, Any], served: str, tokenizer: Any, max_model_len: int) -> GenRequest:
    """A /v1/chat/completions request, validated; the messages rendered and tokenized."""
    messages = check_messages(obj)
    return _common(obj, True, served, encode_chat(tokenizer, messages, True, obj.get("tools")), max_model_len)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any) -> list[int]:
    """The rendered, tokenized chat; any template error (jinja2's TemplateError from
    raise_exception, a bad tools list, ...) is the request's fault: 400, as vLLM answers."""
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except Exception as exc:  # noqa: BLE001 - the template is code the request's data drives
        raise ApiError(f"messages: the chat template failed: {exc}", "messages") from None


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """vLLM's UsageInfo, with prompt_tokens_details when the cached count is known."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def full_response(req: GenRequest, text: str, finish: str, prompt: int, completion: int,
                  cached: int | None) -> bytes:
    """The non-streamed response body."""
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                          "tool_calls": []},
                                  "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                  "prompt_logprobs": None}
        obj = "text_completion"
    return json_encode({"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
                        "choices": [choice], "usage": usage(prompt, completion, cached)})


def chunk(req: GenRequest, text: str, finish: str | None, *, role: bool = False,
          usage_now: dict[str, Any] | None = None) -> bytes:
    """One SSE event with the new text (role=True: the chat stream's opening role delta)."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    body: dict[str, Any] = {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
                            "choices": [choice]}
    if usage_now is not None:
        body["usage"] = usage_now
    return b"data: " + json_encode(body) + b"\n\n"


def usage_chunk(req: GenRequest, use: dict[str, Any]) -> bytes:
    """The last streamed event with include_usage: no choices, the usage."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return b"data: " + json_encode({"id": req.response_id, "object": obj, "created": req.created,
                                    "model": req.model, "choices": [], "usage": use}) + b"\n\n"


DONE = b"data: [DONE]\n\n"

__all__ = ["ApiError", "DONE", "GenRequest", "check_messages", "check_model", "chunk",
           "full_response", "json_encode", "parse_chat", "parse_completion", "parse_json", "prompt_ids",
           "token_ids", "usage", "usage_chunk"]
