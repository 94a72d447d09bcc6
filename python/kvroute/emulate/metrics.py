"""/metrics in Prometheus text format with vLLM's metric names.

Names and types follow vllm/v1/metrics/loggers.py (PrometheusStatLogger), labelled
`model_name` and `engine` as vLLM labels them: gauges vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1); counters
vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total (tokens),
vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total
(by finished_reason); histograms vllm:time_to_first_token_seconds and
vllm:e2e_request_latency_seconds. Times are engine seconds (wall seconds / time_scale).
"""

from __future__ import annotations

from typing import Any

from .runner import EngineRunner, Histogram


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _stat(stats: Any, name: str) -> float:
    value = stats.get(name, 0) if isinstance(stats, dict) else getattr(stats, name, 0)
    return float(value or 0)


def _histogram(lines: list[str], name: str, help_: str, h: Histogram, labels: str) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for bound, count in zip(h.buckets, h.cumulative()):
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {count}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {h.n}')
    lines.append(f"{name}_count{{{labels}}} {h.n}")
    lines.append(f"{name}_sum{{{labels}}} {h.total!r}")


def render(runner: EngineRunner, model: str, engine: int = 0) -> bytes:
    """The metrics text of one emulated engine."""
    labels = f'engine="{engine}",model_name="{_esc(model)}"'
    stats = runner.engine.stats()
    c = runner.counters
    lines: list[str] = []
    gauges = (("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
              ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
              ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"))
    for name, help_, key in gauges:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {_stat(stats, key)!r}"]
    counters = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         _stat(stats, "prefix_queries")),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         _stat(stats, "prefix_hits")),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", float(c.prompt_tokens)),
        ("vllm:generation_tokens", "Number of generation tokens processed.", float(c.generation_tokens)),
    )
    for name, help_, value in counters:
        lines += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter",
                  f"{name}_total{{{labels}}} {value!r}"]
    lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
              "# TYPE vllm:request_success_total counter"]
    for reason in sorted(set(c.success) | {"stop", "length", "abort"}):
        n = c.aborted if reason == "abort" else c.success.get(reason, 0)
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)!r}')
    _histogram(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
               c.ttft, labels)
    _histogram(lines, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
               c.e2e, labels)
    return ("\n".join(lines) + "\n").encode()


__all__ = ["render"]
