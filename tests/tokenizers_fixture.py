"""Hugging Face tokenizer folders trained at test time (BPE on a small corpus, with special
tokens) and chat templates in the layouts real models ship: ChatML (Qwen-2 style, with
tools) and Llama-3 (the 8B-Instruct template)."""

from __future__ import annotations

import json
import os

CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- else %}"
    "{%- if message.role not in ['user', 'assistant', 'system', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message.role) }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CORPUS = [
    "hello world, how are you today? I am fine, thank you.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "Tokens are the cache key: routing needs the exact ids the engine computes.",
    "def route(tokens):\n    return min(replicas, key=cost)\n",
    "Ünïcödé ßtrings, emoji 🙂 and CJK 汉字 are bytes too.",
]


def train_folder(folder: str, kind: str) -> str:
    """Write tokenizer.json + tokenizer_config.json for `kind` ("chatml", "llama3" or
    "metaspace": a sentencepiece-style Metaspace pre-tokenizer with the ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet: list[str] = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "llama3":
        special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    else:
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        config = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
                  "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder
