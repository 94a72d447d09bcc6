"""Hugging Face chat templates rendered the way transformers' `apply_chat_template` renders them.

Followed: huggingface/transformers src/transformers/utils/chat_template_utils.py
(`_cached_compile_jinja_template`, `render_jinja_template`, `_normalize_chat_messages`,
`_alias_reasoning_fields`) and src/transformers/tokenization_utils_base.py
(`apply_chat_template`: template kwargs are the named special tokens overridden by the
caller's kwargs; the rendered text is tokenized with add_special_tokens=False;
`get_chat_template`: a dict of named templates uses "tool_use" when tools are given and it
exists, else "default"). Same environment: jinja2's ImmutableSandboxedEnvironment (chat
templates come from the Hub and are untrusted code) with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `tojson` filter that does not HTML-escape (json.dumps with
ensure_ascii=False), globals `raise_exception` (TemplateError), `strftime_now`, `dict` and a
`namespace` that refuses underscore names. The `{% generation %}` tag renders its body (the
assistant-mask tracking transformers adds is of no use to routing).

Each template is compiled once, when the tokenizer loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace without underscore-prefixed names (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = Namespace
    return env


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as fresh dicts without None-valued keys, reasoning aliased under every name the
    templates read (transformers' `_normalize_chat_messages` + `_alias_reasoning_fields`)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object, not {type(m).__name__}")
        d = {k: v for k, v in m.items() if v is not None}
        reasoning = next((d[k] for k in _REASONING_FIELDS if d.get(k) is not None), None)
        if reasoning is not None:
            d = {"thinking": reasoning, **d, "reasoning_content": reasoning}
        out.append(d)
    return out


class ChatTemplate:
    """One or several named Jinja chat templates, compiled once, rendered like transformers.

    template: the template string, or a mapping name -> template (tokenizer_config.json's list
    form); special_tokens: the named special tokens the template sees (bos_token, eos_token...).
    """

    def __init__(self, template: str | Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        env = _environment()
        named = {"default": template} if isinstance(template, str) else dict(template)
        self._compiled = {name: env.from_string(src) for name, src in named.items()}
        self._special = dict(special_tokens)

    def _pick(self, tools: Any) -> Any:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ValueError(f"the tokenizer has several chat templates and none named 'default': "
                         f"{sorted(self._compiled)}")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text; kwargs reach the template (e.g. enable_thinking) and override special tokens."""
        if tools is not None:
            for i, t in enumerate(tools):
                if not isinstance(t, Mapping):
                    raise ValueError(f"tools[{i}] must be a JSON schema object")
        variables = {**self._special, **kwargs}
        return str(self._pick(tools).render(messages=normalize_messages(messages),
                                            tools=None if tools is None else [dict(t) for t in tools],
                                            documents=None, add_generation_prompt=add_generation_prompt,
                                            **variables))
