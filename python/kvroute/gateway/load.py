"""Engine load and health: a periodic scrape of each engine's Prometheus /metrics into
Router.report_load, GET /health probes that drive the circuit breakers, and /v1/models.

Metric names (gauges; several series of one name, e.g. data-parallel ranks, are summed, KV
usage takes the maximum):
- vLLM (vllm/v1/metrics/loggers.py): vllm:num_requests_waiting, vllm:num_requests_running,
  vllm:kv_cache_usage_perc (a fraction; vllm:gpu_cache_usage_perc before v0.10).
- SGLang (python/sglang/srt/metrics/collector.py): sglang:num_queue_reqs,
  sglang:num_running_reqs, sglang:token_usage (fraction of KV tokens in use).
"""

from __future__ import annotations

from typing import Any

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_WANTED = {**{n: "waiting" for n in WAITING}, **{n: "running" for n in RUNNING},
           **{n: "kv_usage" for n in KV_USAGE}}


def parse_load(text: str) -> dict[str, Any]:
    """waiting, running (ints) and kv_usage (0..1) from a Prometheus text exposition; keys
    whose metric is absent are left out."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(("vllm:", "sglang:")):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        key = _WANTED.get(line[:name_end])
        if key is None:
            continue
        value_text = line[line.rfind("}") + 1:].split() if "{" in line[:name_end + 1] else line[name_end:].split()
        try:
            value = float(value_text[0])
        except (IndexError, ValueError):
            continue
        if value != value:  # NaN
            continue
        sums[key] = max(sums.get(key, 0.0), value) if key == "kv_usage" else sums.get(key, 0.0) + value
    out: dict[str, Any] = {}
    for key in ("waiting", "running"):
        if key in sums:
            out[key] = max(0, int(round(sums[key])))
    if "kv_usage" in sums:
        out["kv_usage"] = min(1.0, max(0.0, sums["kv_usage"]))
    return out


def parse_models(obj: Any) -> tuple[list[dict[str, Any]], set[str]]:
    """(model entries, LoRA adapter names) from an OpenAI /v1/models body; vLLM lists
    adapters with a "parent" (the base model)."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return [], set()
    models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    return models, {m["id"] for m in models if m.get("parent")}
