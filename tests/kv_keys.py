"""Event encoders with per-request keys, groups and media for the precise-mode tests, in each
engine's wire form (kv-events.md A2, A3, D): vLLM 0.23 positional arrays ("vllm-array"), vLLM
0.33 tagged maps ("vllm-map"), SGLang 0.5.18 positional arrays with a trailing
{"cache_salt"} map ("sglang"), SGLang 0.5.23 tagged maps ("sglang-map")."""

from __future__ import annotations

from typing import Any

FORMATS = ("vllm-array", "vllm-map", "sglang", "sglang-map")
VLLM = ("vllm-array", "vllm-map")


def stored(fmt: str, hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *,
           medium: str | None = "GPU", lora: str | None = None, salt: str | None = None,
           mm: list[list[Any]] | None = None, group: int | None = None, extra: Any = None) -> Any:
    """One BlockStored. vLLM carries the salt as the string on block 0's extra_keys (after the
    LoRA name and the (identifier, relative offset) pairs of `mm`, per block), SGLang in its
    cache_salt field. `extra` replaces the computed extra_keys when given."""
    if fmt in VLLM:
        if extra is None and (lora or salt or mm):
            extra = []
            for j in range(len(hashes)):
                keys: list[Any] = [lora] if lora else []
                keys += (mm[j] if mm and j < len(mm) else [])
                if salt and j == 0 and parent is None:
                    keys.append(salt)
                extra.append(keys or None)
        if fmt == "vllm-array":
            return ["BlockStored", hashes, parent, tokens, block_size, None, medium, lora, extra,
                    0 if group is None else group, "full_attention", None]
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
              "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora}
        if extra is not None:
            ev["extra_keys"] = extra
        if group is not None:
            ev["group_idx"] = group
            ev["kv_cache_spec_kind"] = "full_attention" if group == 0 else "sliding_window"
        return ev
    if fmt == "sglang":
        ev = ["BlockStored", hashes, parent, tokens, block_size, None, medium]
        return ev + [{"cache_salt": salt}] if salt else ev
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": medium, "cache_salt": salt,
            "session_id": None, "lora_name": lora}


def removed(fmt: str, hashes: list[Any], *, medium: str | None = "GPU", group: int | None = None) -> Any:
    """One BlockRemoved."""
    if fmt == "vllm-array":
        return ["BlockRemoved", hashes, medium, 0 if group is None else group]
    if fmt == "vllm-map":
        ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        if group is not None:
            ev["group_idx"] = group
        return ev
    if fmt == "sglang":
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
