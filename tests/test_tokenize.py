"""kvroute.tokenize: the built-in tokenizer, Hugging Face tokenizers with their chat templates
(ids equal transformers' apply_chat_template, full and incremental), and the session cache."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.tokenize import ByteTokenizer, IncrementalEncoder, Tokenizer, load_tokenizer
from tests.tokenizers_fixture import train_folder

KINDS = ("chatml", "llama3", "metaspace")


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(kvroute tokenizer, transformers tokenizer) over one trained folder."""
    folder = train_folder(str(tmp_path_factory.mktemp(request.param)), request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer

        reference = AutoTokenizer.from_pretrained(folder)
    return load_tokenizer(folder), reference


def hf_ids(reference, messages, **kwargs):
    out = reference.apply_chat_template(messages, add_generation_prompt=kwargs.pop("add_generation_prompt", True),
                                        **kwargs)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


TEXT = st.lists(st.sampled_from(list("ab xyz\n\t  .,'?") + ["hello", " world", "Ü", "🙂", "汉", "<|im_end|>",
                                                              "<|eot_id|>", "<|im_start|>"]), max_size=20).map("".join)


def conversation(texts: list[str]) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return [{"role": "system", "content": "Be brief."}] + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


CHAT = conversation(["hello world", "I am fine, thank you.", "  the quick\nbrown fox 🙂  ", "汉字?"])


def test_builtin_roundtrip_and_template():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    text = tok.render_chat(CHAT)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(CHAT)
    assert tok.decode(ids) == text
    assert ids.count(257) == len(CHAT) + 1 and max(ids) < tok.vocab_size
    assert tok.encode("a<|im_end|>") == [97, 258]
    assert tok.render_chat(CHAT, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]


@given(text=TEXT)
def test_builtin_encode_array_equals_encode(text):
    tok = load_tokenizer(None)
    arr = tok.encode_array(text)
    assert arr.dtype == np.int32 and arr.tolist() == tok.encode(text)


def test_builtin_bad_input():
    tok = load_tokenizer(None)
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ids: 999"):
        tok.decode([999])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.render_chat([{"role": "user", "content": "x"}, {"content": "no role"}])
    with pytest.raises(ValueError, match="tokenizer: .*does not exist"):
        load_tokenizer("/nonexistent/folder")


def test_hf_equals_transformers(pair):
    tok, reference = pair
    for gen in (True, False):
        assert tok.render_chat(CHAT, add_generation_prompt=gen) == reference.apply_chat_template(
            CHAT, add_generation_prompt=gen, tokenize=False)
        assert tok.encode_chat(CHAT, add_generation_prompt=gen) == hf_ids(reference, CHAT, add_generation_prompt=gen)
    for text in ("hello world", " the lazy dog<|im_end|>\n", "🙂 汉字"):
        assert tok.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text, add_special_tokens=True) == reference(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == reference.decode(tok.encode(text))


def test_hf_tools_and_raise_exception(tmp_path):
    folder = train_folder(str(tmp_path), "chatml")
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(folder)
    tok = load_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "wetter", "description": "Wetter in Köln <b>",
                                               "parameters": {"type": "object", "properties": {}}}}]
    assert tok.encode_chat(CHAT, tools=tools) == hf_ids(reference, CHAT, tools=tools)
    assert "Köln <b>" in tok.render_chat(CHAT, tools=tools)  # tojson neither escapes HTML nor ASCII
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        tok.render_chat([{"role": "robot", "content": "x"}])


def test_hf_sandboxed(tmp_path):
    import jinja2
    from kvroute.tokenize.template import ChatTemplate

    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.render([{"role": "user", "content": "x"}])
    ns = ChatTemplate("{% set ns = namespace(_x=1) %}", {})
    with pytest.raises(jinja2.exceptions.SecurityError, match="_x"):
        ns.render([])
    assert ChatTemplate("{{ strftime_now('%Y') | length }}{{ bos_token }}", {"bos_token": "<s>"}).render([]) == "4<s>"


def test_hf_template_file_and_named_templates(tmp_path):
    folder = train_folder(str(tmp_path), "chatml")
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert load_tokenizer(folder).render_chat([{"role": "user", "content": "x"}]) == "[user]"


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6), data=st.data())
def test_incremental_equals_full(tmp_path_factory, kind, turns, data):
    """A conversation's turns through one session: every turn's ids equal full tokenization,
    and equal transformers' ids."""
    tok, reference = _trained(tmp_path_factory, kind)
    enc = IncrementalEncoder(tok, max_sessions=2)
    texts: list[str] = []
    for user, answer in turns:
        texts.append(user)
        messages = conversation(texts)
        ids = enc.encode_chat("s", messages)
        assert ids.dtype == np.int32
        assert ids.tolist() == tok.encode_chat(messages) == hf_ids(reference, messages)
        if data.draw(st.booleans()):  # sometimes the client edits history: still equal
            texts[0] = data.draw(TEXT)
        texts.append(answer)
    assert enc.stats.hits + enc.stats.misses == len(turns)
    if tok.incremental_safe and len(turns) > 1:
        assert enc.stats.hits > 0


def test_incremental_safety_probe():
    """The trained tokenizers split at special tokens (Metaspace with prepend_scheme="first"
    included: a suffix that starts with a special token has no first piece to prepend to); a
    tokenizer that marks the end of every text does not, so its boundaries are given up and
    incremental tokenization is full tokenization."""

    class Marks(ByteTokenizer):
        def encode(self, text, *, add_special_tokens=False):
            return super().encode(text) + [256]

        encode_array = Tokenizer.encode_array  # through encode, not the byte fast path

    assert load_tokenizer(None).check_boundaries()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            safe = {kind: load_tokenizer(train_folder(os.path.join(d, kind), kind)).incremental_safe for kind in KINDS}
    assert safe == {"chatml": True, "llama3": True, "metaspace": True}
    tok = Marks()
    assert not tok.check_boundaries() and not tok.incremental_safe
    enc = IncrementalEncoder(tok)
    for n in range(1, 4):
        msgs = conversation(["q"] * n)
        assert enc.encode_chat("s", msgs).tolist() == tok.encode_chat(msgs)
    assert enc.stats.hits == 0


_TRAINED: dict[str, tuple] = {}


def _trained(factory, kind):
    if kind not in _TRAINED:
        folder = train_folder(str(factory.mktemp(kind)), kind)
        from transformers import AutoTokenizer

        _TRAINED[kind] = (load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))
    return _TRAINED[kind]


def test_incremental_reuses_and_is_bounded():
    tok = load_tokenizer(None)
    enc = IncrementalEncoder(tok, max_sessions=2)
    texts = ["first question"]
    first = enc.encode_chat("a", conversation(texts))
    texts += ["an answer", "second question"]
    ids = enc.encode_chat("a", conversation(texts))
    assert ids.tolist() == tok.encode_chat(conversation(texts))
    # everything before the generation prompt's <|im_start|> is reused
    assert enc.stats.hits == 1 and enc.stats.reused_tokens == len(first) - len(tok.encode("<|im_start|>assistant\n"))
    enc.encode_chat("b", conversation(["x"]))
    enc.encode_chat("c", conversation(["y"]))
    assert len(enc) == 2
    enc.encode_chat("a", conversation(texts))  # "a" was evicted: a miss, still right
    assert enc.stats.misses == 4
    assert enc.encode_chat(None, conversation(texts)).tolist() == tok.encode_chat(conversation(texts))
    assert len(enc) == 2
    with pytest.raises(ValueError, match="max_sessions"):
        IncrementalEncoder(tok, max_sessions=0)


def test_incremental_unpairable_boundaries_fall_back():
    """A tokenizer whose special tokens cannot be paired with the ids is never reused."""

    class Odd(ByteTokenizer):
        def boundaries(self, text, ids):
            return None

    tok = Odd()
    enc = IncrementalEncoder(tok)
    for n in range(1, 4):
        msgs = conversation(["q"] * n)
        assert enc.encode_chat("s", msgs).tolist() == tok.encode_chat(msgs)
    assert enc.stats.hits == 0 and enc.stats.reused_tokens == 0
