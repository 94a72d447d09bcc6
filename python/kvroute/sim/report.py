"""Presenting simulator results: the comparison table, JSON and the per-replica plot."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .fleet import SimResult

COLUMNS = ("router", "hit rate", "mean TTFT", "p90 TTFT", "busiest/mean", "fleet prefill")


def fmt_seconds(value: float | None) -> str:
    """1.95 s, 882 ms; '-' for no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value < 1.0:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def rows(results: Sequence[SimResult]) -> list[list[str]]:
    """One row of formatted cells per result, in COLUMNS order."""
    out = []
    for res in results:
        m = res.metrics
        out.append([
            res.router,
            _pct(m.hit_rate),
            fmt_seconds(m.ttft_mean),
            fmt_seconds(m.ttft_p90),
            _ratio(m.busiest_over_mean),
            f"{m.fleet_prefill_s:,.0f} s",
        ])
    return out


def markdown_table(results: Sequence[SimResult], columns: Sequence[str] = COLUMNS) -> str:
    """The comparison as a Markdown table (the explainer's layout)."""
    body = rows(results)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[: len(columns)]) + " |" for r in body]
    return "\n".join(lines)


def text_table(results: Sequence[SimResult]) -> str:
    """The comparison as aligned plain text, for a terminal."""
    body = [list(COLUMNS)] + rows(results)
    widths = [max(len(r[i]) for r in body) for i in range(len(COLUMNS))]
    lines = []
    for k, r in enumerate(body):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def as_json(results: Sequence[SimResult], **context: Any) -> dict[str, Any]:
    """Every result's metrics, plus whatever context (workload, fleet, ...) is given."""
    return {**context, "results": [r.as_dict() for r in results]}


def plot(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """Per-replica prefill seconds as bars, one panel per router (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n + 0.6, 3.2), sharey=True, squeeze=False)
    for ax, res in zip(axes[0], results):
        per = res.metrics.replica_prefill_s
        ax.bar(range(len(per)), per, color="#4c72b0")
        ax.set_title(f"{res.router}\nhit {_pct(res.metrics.hit_rate)}, p90 {fmt_seconds(res.metrics.ttft_p90)}",
                     fontsize=9)
        ax.set_xlabel("replica")
        ax.set_xticks(range(len(per)))
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("prefill seconds")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["COLUMNS", "as_json", "fmt_seconds", "markdown_table", "plot", "rows", "text_table"]
