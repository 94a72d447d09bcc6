"""Presenting simulator results: the comparison table, JSON and the per-replica plot."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .fleet import SimResult
from .sweep import SweepResult

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


def aligned_table(columns: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Rows of cells as aligned plain text under a header and a rule: the first column
    left-aligned, the others right-aligned (kvroute simulate's and kvroute bench's layout)."""
    table = [list(columns)] + [list(r) for r in body]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = []
    for k, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def text_table(results: Sequence[SimResult]) -> str:
    """The comparison as aligned plain text, for a terminal."""
    return aligned_table(COLUMNS, rows(results))


def as_json(results: Sequence[SimResult], **context: Any) -> dict[str, Any]:
    """Every result's metrics, plus whatever context (workload, fleet, ...) is given."""
    return {**context, "results": [r.as_dict() for r in results]}


def plot(results: Sequence[SimResult], path: str, title: str = "",
         sweeps: Sequence[SweepResult] | None = None) -> None:
    """Per-replica prefill seconds as bars, one panel per router (matplotlib, Agg); with
    sweeps, a first panel draws p90 TTFT against arrival rate per router, the SLO dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    extra = 1 if sweeps else 0
    fig, axes = plt.subplots(1, n + extra, figsize=(2.6 * n + 0.6 + 4.2 * extra, 3.2), squeeze=False,
                             gridspec_kw={"width_ratios": [1.8] * extra + [1] * n})
    if sweeps:
        _sweep_panel(axes[0][0], sweeps)
        for ax in axes[0][2:]:
            ax.sharey(axes[0][1])
    else:
        for ax in axes[0][1:]:
            ax.sharey(axes[0][0])
    for ax, res in zip(axes[0][extra:], results):
        per = res.metrics.replica_prefill_s
        ax.bar(range(len(per)), per, color="#4c72b0")
        ax.set_title(f"{res.router}\nhit {_pct(res.metrics.hit_rate)}, p90 {fmt_seconds(res.metrics.ttft_p90)}",
                     fontsize=9)
        ax.set_xlabel("replica")
        ax.set_xticks(range(len(per)))
        ax.tick_params(labelsize=7)
    axes[0][extra].set_ylabel("prefill seconds")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sweep_panel(ax: Any, sweeps: Sequence[SweepResult]) -> None:
    for sw in sweeps:
        pts = [p for p in sw.points if math.isfinite(p.arrival_rate)]
        ax.plot([p.arrival_rate for p in pts], [p.ttft_p90 for p in pts], marker="o", ms=3, lw=1.2,
                label=f"{sw.router} ({sw.goodput:.2f}/s)")
    ax.axhline(sweeps[0].slo, color="k", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("p90 TTFT (s)")
    ax.set_title(f"goodput at p90 TTFT <= {sweeps[0].slo:g} s", fontsize=9)
    ax.legend(fontsize=6)
    ax.tick_params(labelsize=7)


def sweep_rows(sweeps: Sequence[SweepResult]) -> list[list[str]]:
    """Per router: goodput (req/s), its rate factor, p90 TTFT and hit rate there, runs."""
    out = []
    for sw in sweeps:
        pt = sw.at(sw.goodput_scale) if sw.goodput_scale else None
        out.append([sw.router, f"{sw.goodput:.3f}/s", f"x{sw.goodput_scale:.3g}" if pt else "-",
                    fmt_seconds(pt.ttft_p90) if pt else "-", _pct(pt.result.metrics.hit_rate) if pt else "-",
                    str(len(sw.points))])
    return out


SWEEP_COLUMNS = ("router", "goodput", "rate factor", "p90 TTFT", "hit rate", "runs")


def sweep_table(sweeps: Sequence[SweepResult]) -> str:
    """Goodput per router as aligned plain text."""
    return aligned_table(SWEEP_COLUMNS, sweep_rows(sweeps))


__all__ = ["COLUMNS", "SWEEP_COLUMNS", "aligned_table", "as_json", "fmt_seconds", "markdown_table", "plot", "rows", "sweep_rows",
           "sweep_table", "text_table"]
