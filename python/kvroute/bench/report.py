"""What `kvroute bench` prints: one summary per server, as a table, JSON or TTFT CDFs.

Definitions match kvroute simulate's (kvroute.sim.metrics) where a client can measure
them: hit rate = cached prompt tokens / prompt tokens over requests whose usage reports
cached tokens (prompt_tokens_details.cached_tokens); TTFT from sending the request to the
first streamed token; TPOT = (e2e - TTFT) / (completion tokens - 1); throughput =
completed requests per wall second. The simulator's busiest/mean and fleet prefill are
server-side quantities no client sees, so the table leaves them out.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from ..sim.metrics import percentile
from ..sim.report import aligned_table, fmt_seconds
from .client import RequestResult

COLUMNS = ("server", "hit rate", "mean TTFT", "p90 TTFT", "p50 TPOT", "p50 e2e", "throughput", "errors")


@dataclass(frozen=True)
class Summary:
    """One run against one server (times in seconds; nan when nothing was measured)."""

    label: str
    requests: int
    completed: int
    errors: int
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reported_cached: int = 0
    hit_rate: float = math.nan
    ttft_mean: float = math.nan
    ttft_p50: float = math.nan
    ttft_p90: float = math.nan
    ttft_p99: float = math.nan
    tpot_p50: float = math.nan
    e2e_p50: float = math.nan
    e2e_p90: float = math.nan
    throughput_rps: float = math.nan
    output_tokens_per_s: float = math.nan
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values (nan becomes None)."""
        out = asdict(self)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def summarize(label: str, results: Sequence[RequestResult], wall_s: float) -> Summary:
    """The summary of one run's per-request results."""
    ok = [r for r in results if r.error is None]
    with_cache = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in with_cache)
    cached = sum(int(r.cached_tokens or 0) for r in with_cache)
    ttft = np.array([r.ttft for r in ok], dtype=np.float64)
    tpot = np.array([r.tpot for r in ok if not math.isnan(r.tpot)], dtype=np.float64)
    e2e = np.array([r.e2e for r in ok], dtype=np.float64)
    kinds = Counter(r.error for r in results if r.error is not None)
    return Summary(
        label=label, requests=len(results), completed=len(ok), errors=sum(kinds.values()),
        errors_by_kind=dict(sorted(kinds.items())),
        prompt_tokens=sum(r.prompt_tokens for r in ok), cached_tokens=cached, reported_cached=len(with_cache),
        hit_rate=cached / prompt if prompt else math.nan,
        ttft_mean=float(ttft.mean()) if ttft.size else math.nan,
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), e2e_p50=percentile(e2e, 50), e2e_p90=percentile(e2e, 90),
        throughput_rps=len(ok) / wall_s if wall_s > 0 else math.nan,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else math.nan,
        wall_s=wall_s,
    )


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1%}"


def row(s: Summary) -> list[str]:
    """The formatted cells of one summary, in COLUMNS order."""
    errors = str(s.errors) if not s.errors else f"{s.errors} ({', '.join(f'{k}: {n}' for k, n in s.errors_by_kind.items())})"
    thr = "-" if math.isnan(s.throughput_rps) else f"{s.throughput_rps:.1f} req/s"
    return [s.label, _pct(s.hit_rate), fmt_seconds(s.ttft_mean), fmt_seconds(s.ttft_p90),
            fmt_seconds(s.tpot_p50), fmt_seconds(s.e2e_p50), thr, errors]


def text_table(summaries: Sequence[Summary]) -> str:
    """Aligned plain text, kvroute simulate's layout."""
    return aligned_table(COLUMNS, [row(s) for s in summaries])


def plot_ttft(runs: Sequence[tuple[str, Sequence[RequestResult]]], path: str, title: str = "") -> None:
    """TTFT CDFs, one line per server (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, results in runs:
        ttft = np.sort([r.ttft for r in results if r.error is None and not math.isnan(r.ttft)])
        if ttft.size:
            ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["COLUMNS", "Summary", "plot_ttft", "row", "summarize", "text_table"]
