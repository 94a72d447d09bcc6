"""`kvroute diagnose`: which of the seed's failure modes a trace shows, in one page.

diagnose(trace, params) gathers, for a fleet of `replicas` x `cache_tokens`:

- the miss-ratio curve of one pooled cache (mrc.estimate) and of the fleet's caches
  split by the chosen router (mrc.per_replica over the router's placements in a
  simulated replay), so "how much KV memory would reach X%" and "how much does routing
  cost against one shared cache" are read off the same curves;
- a simulated replay (kvroute.sim.simulate, precise knowledge) for TTFT, split into cold
  start (requests that arrive before the fleet has seen as many distinct blocks as its
  caches hold: the caches are still filling; at least the first 5% and at most the first
  half of the requests) and warm (the rest), and per replica;
- the ideal fleet (kvroute.sim.ideal: one shared cache, one central queue) and the
  router as a fraction of it;
- the volatile-prefix detector (token traces only: a Mooncake trace has no tokens).

render_text() writes the one-minute report; as_json() the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import mrc
from .stream import Trace
from .volatile import VolatilePrefixDetector

#: Hit-rate targets reported as fractions of what an infinite cache reaches.
TARGETS = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class DiagnoseParams:
    """The fleet to diagnose for. cache_tokens: KV tokens per replica (None: the
    simulator's default for the trace kind). router: a kvroute.sim router name.
    simulate: replay the trace in the simulator (TTFT, placements, ideal). points: sizes
    on the curves. decode: token ids -> text for the volatile-prefix samples."""

    replicas: int = 8
    cache_tokens: int | None = None
    router: str = "ttft"
    simulate: bool = True
    points: int = 40
    decode: Callable[[list[int]], str] | None = None


def diagnose(trace: Trace, params: DiagnoseParams | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every number of the report, JSON-ready (see the module docstring)."""
    from .. import sim

    p = params or DiagnoseParams()
    say = progress or (lambda _msg: None)
    stream = trace.stream
    bt = stream.block_tokens
    cache_tokens = p.cache_tokens or sim.CACHE_TOKENS["trace" if trace.format == "mooncake" else "chat"]
    fleet = sim.FleetParams(replicas=p.replicas, cache_tokens=cache_tokens)
    per = fleet.cache_blocks(bt)
    distinct = int(len(np.unique(stream.hashes)))
    sizes = np.unique(np.concatenate([mrc.default_sizes(max(distinct, per * p.replicas), p.points),
                                      [per, per * p.replicas, max(distinct, 1)]]))
    say("miss-ratio curve")
    pooled = mrc.estimate(stream, sizes)
    out: dict[str, Any] = {
        "trace": {"path": trace.path, "format": trace.format, "requests": stream.num_ops,
                  "input_tokens": stream.input_tokens, "blocks": int(stream.looked_up().sum()),
                  "distinct_blocks": distinct, "block_tokens": bt},
        "fleet": {"replicas": p.replicas, "cache_tokens_per_replica": cache_tokens, "router": p.router},
        "infinite_cache_hit_rate": float(pooled.hit_rate[-1]),
        "pooled": pooled.as_dict(),
        "pooled_at_fleet_cache": _at(pooled, per * p.replicas),
        "pooled_tokens_for": _targets(pooled),
    }
    if p.simulate:
        _simulated(out, trace, fleet, p, sizes, per, say)
    if trace.prompts is not None:
        say("volatile prefixes")
        det = VolatilePrefixDetector(bt)
        for toks, i in zip(trace.prompts, range(stream.num_ops)):
            det.observe(toks, stream.blocks(i))
        out["volatile"] = det.report(p.decode).as_dict()
    out["findings"] = findings(out)
    return out


def _simulated(out: dict[str, Any], trace: Trace, fleet: Any, p: DiagnoseParams, sizes: np.ndarray, per: int,
               say: Callable[[str], None]) -> None:
    from .. import sim
    from ..sim.ideal import fraction_of_ideal, simulate_ideal

    say(f"simulating {p.router}")
    res = sim.simulate(trace.workload, p.router, fleet)
    say("simulating the ideal fleet")
    ideal = simulate_ideal(trace.workload, fleet)
    rec = res.records
    placement = np.empty(trace.stream.num_ops, dtype=np.int64)
    placement[rec.client] = rec.replica  # single-turn traces: client i is request i
    say("per-replica curves")
    curves = mrc.per_replica(trace.stream.with_replica(placement), sizes)
    split = mrc.fleet_hit_rate(curves, sizes)
    served = ~np.isnan(rec.ttft)  # the simulator rejects requests longer than a replica's KV
    cold = _cold_mask(trace, rec, fleet.cache_blocks(trace.stream.block_tokens) * fleet.replicas)
    out["split"] = {"sizes_blocks_per_replica": sizes.tolist(), "hit_rate": [round(float(x), 6) for x in split],
                    "at_fleet_cache": float(split[int(np.searchsorted(sizes, per))])}
    out["simulated"] = {"router": _run(res.metrics), "ideal": _run(ideal.metrics),
                        "fraction_of_ideal": {k: _num(v) for k, v in fraction_of_ideal(res, ideal).items()},
                        "cold": _ttft(rec.ttft[cold & served], rec, cold & served),
                        "warm": _ttft(rec.ttft[~cold & served], rec, ~cold & served),
                        "rejected": int((~served).sum()), "replicas": _replicas(rec, fleet.replicas, served)}


def _cold_mask(trace: Trace, rec: Any, fleet_blocks: int) -> np.ndarray:
    """Requests (in rec's order) that arrived while the fleet's caches were still filling."""
    stream = trace.stream
    seen: set[int] = set()
    n = stream.num_ops
    fill = n
    for i in range(n):
        seen.update(stream.blocks(i).tolist())
        if len(seen) >= fleet_blocks:
            fill = i + 1
            break
    fill = min(max(fill, math.ceil(0.05 * n)), n // 2 or 1)
    order = np.argsort(rec.arrival, kind="stable")
    mask = np.zeros(len(rec.arrival), dtype=bool)
    mask[order[:fill]] = True
    return mask


def _run(m: Any) -> dict[str, Any]:
    return {"hit_rate": _num(m.hit_rate), "ttft_p50": _num(m.ttft_p50), "ttft_p90": _num(m.ttft_p90),
            "ttft_mean": _num(m.ttft_mean), "busiest_over_mean": _num(m.busiest_over_mean)}


def _ttft(ttft: np.ndarray, rec: Any, mask: np.ndarray) -> dict[str, Any]:
    tokens = int(rec.prompt_tokens[mask].sum())
    return {"requests": int(mask.sum()), "ttft_p50": _num(np.percentile(ttft, 50)) if ttft.size else None,
            "ttft_p90": _num(np.percentile(ttft, 90)) if ttft.size else None,
            "hit_rate": _num(rec.cached_tokens[mask].sum() / tokens) if tokens else None}


def _replicas(rec: Any, n: int, served: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for r in range(n):
        m = (rec.replica == r) & served
        tokens = int(rec.prompt_tokens[m].sum())
        rows.append({"replica": r, "requests": int(m.sum()), "joined_s": 0.0,
                     "hit_rate": _num(rec.cached_tokens[m].sum() / tokens) if tokens else None,
                     "ttft_p90": _num(np.percentile(rec.ttft[m], 90)) if m.any() else None})
    return rows


def _at(curve: mrc.Curve, size: int) -> float:
    return float(curve.hit_rate[int(np.searchsorted(curve.sizes, size))])


def _targets(curve: mrc.Curve) -> dict[str, int | None]:
    top = float(curve.hit_rate[-1])
    out = {}
    for f in TARGETS:
        size = curve.size_for(f * top) if top > 0 else None
        out[f"{f:g}"] = None if size is None else size * curve.block_tokens
    return out


def _num(x: Any) -> float | None:
    x = float(x)
    return None if math.isnan(x) else round(x, 6)


def findings(d: dict[str, Any]) -> list[str]:
    """The failure modes the numbers point at, most costly first (plain sentences)."""
    out = []
    vol = d.get("volatile")
    if vol and vol["found"]:
        top = vol["divergence_offsets"][0]["offset"]
        out.append(f"VOLATILE PREFIX: {vol['affected_prompts']:,} of {vol['prompts']:,} prompts repeat earlier text "
                   f"after a top that differs (most at token {top}); the cache loses {vol['lost_fraction']:.0%} of "
                   "input tokens. Move whatever changes per request (time, request id, user name, unordered "
                   "tool lists) below the shared part of the prompt.")
    inf, fleet_hit = d["infinite_cache_hit_rate"], d["pooled_at_fleet_cache"]
    if inf > 0 and fleet_hit < 0.9 * inf:
        need = d["pooled_tokens_for"].get("0.9")
        reps = d["fleet"]["replicas"]
        more = f"; about {need / reps:,.0f} tokens per replica would reach 90% of it" if need else ""
        out.append(f"CACHE TOO SMALL: even one pooled cache of the fleet's memory reaches {fleet_hit:.1%} of the "
                   f"{inf:.1%} an infinite cache would{more}.")
    sim = d.get("simulated")
    if sim:
        split, pooled = d["split"]["at_fleet_cache"], fleet_hit
        if pooled > 0 and split < 0.9 * pooled:
            out.append(f"ROUTING SPLITS THE CACHE: under {d['fleet']['router']} the replicas' caches reach "
                       f"{split:.1%} against {pooled:.1%} for one pooled cache of the same memory.")
        cold, warm = sim["cold"]["ttft_p90"], sim["warm"]["ttft_p90"]
        if cold and warm and cold > 1.5 * warm:
            out.append(f"COLD START: p90 TTFT is {cold:.2f} s while the caches fill (first "
                       f"{sim['cold']['requests']:,} requests) against {warm:.2f} s warm; benchmarks that loop "
                       "over warm prompts miss this.")
        frac = sim["fraction_of_ideal"]["ttft_p90"]
        if frac is not None and frac < 0.5:
            out.append(f"QUEUEING: p90 TTFT is {sim['router']['ttft_p90']:.2f} s against {sim['ideal']['ttft_p90']:.2f} s "
                       "for the ideal fleet (one shared cache, one central queue, shortest first): requests "
                       "queue where the ideal's central queue would have found a replica.")
    if not out:
        out.append("No failure mode stands out: the fleet's caches hold the working set and the router keeps "
                   "most of what one shared cache would.")
    return out


def render_text(d: dict[str, Any]) -> str:
    """The one-minute report."""
    t, f = d["trace"], d["fleet"]
    lines = [f"kvroute diagnose {t['path']} ({t['format']}, {t['block_tokens']}-token blocks): {t['requests']:,} "
             f"requests, {t['input_tokens']:,} input tokens, {t['blocks']:,} blocks ({t['distinct_blocks']:,} distinct)",
             f"fleet: {f['replicas']} replicas x {f['cache_tokens_per_replica']:,} KV tokens, router {f['router']}", "",
             "hit rate (cached input tokens / input tokens)",
             f"  infinite cache                        {d['infinite_cache_hit_rate']:6.1%}",
             f"  one pooled cache of the fleet's KV    {d['pooled_at_fleet_cache']:6.1%}"
             f"   (SHARDS, sampling rate {d['pooled']['sampling_rate']:.3g})"]
    sim = d.get("simulated")
    if sim:
        lines += [f"  {f['replicas']} caches as {f['router']} splits them".ljust(40) + f"{d['split']['at_fleet_cache']:6.1%}",
                  f"  simulated, {f['router']}".ljust(40) + f"{sim['router']['hit_rate']:6.1%}"
                  f"   ideal fleet {sim['ideal']['hit_rate']:.1%} (evicting by next use)"]
    need = ", ".join(f"{float(k):.0%}: {v:,} tokens" if v else f"{float(k):.0%}: -"
                     for k, v in d["pooled_tokens_for"].items())
    lines.append(f"KV memory for a share of the infinite cache's hit rate (one pooled cache): {need}")
    if sim:
        fr = sim["fraction_of_ideal"]
        lines += ["", f"TTFT (simulated)  {f['router']}: p50 {sim['router']['ttft_p50']:.2f} s, p90 "
                  f"{sim['router']['ttft_p90']:.2f} s;  ideal: p50 {sim['ideal']['ttft_p50']:.2f} s, p90 "
                  f"{sim['ideal']['ttft_p90']:.2f} s",
                  f"  cold start ({sim['cold']['requests']:,} requests, caches filling): p50 {sim['cold']['ttft_p50']:.2f}"
                  f" s, p90 {sim['cold']['ttft_p90']:.2f} s;  warm: p50 {sim['warm']['ttft_p50']:.2f} s, p90 "
                  f"{sim['warm']['ttft_p90']:.2f} s",
                  f"  fraction of the ideal: hit rate {_pct(fr['hit_rate'])}, p90 TTFT {_pct(fr['ttft_p90'])}"]
    vol = d.get("volatile")
    lines.append("")
    if vol is None:
        lines.append("volatile prefixes: not checked (this trace has no tokens; use --format tokens)")
    elif not vol["found"]:
        lines.append(f"volatile prefixes: none in {vol['prompts']:,} prompts")
    else:
        offs = ", ".join(f"token {o['offset']} ({o['prompts']:,})" for o in vol["divergence_offsets"])
        lines.append(f"volatile prefixes: {vol['affected_prompts']:,} prompts, {vol['lost_tokens']:,} tokens of cache "
                     f"lost ({vol['lost_fraction']:.1%}); divergence at {offs}")
        for s in vol["samples"][:2]:
            lines.append(f"  prompt {s['prompt']} vs {s['earlier']} at token {s['offset']}: {s['text']!r}")
            lines.append(f"  {'':>{len(str(s['prompt'])) + len(str(s['earlier'])) + 18}}{s['earlier_text']!r}")
    lines += ["", "findings:"] + [f"  - {x}" for x in d["findings"]]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def plot(d: dict[str, Any], path: str) -> None:
    """The miss-ratio curves (hit rate vs total KV tokens) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    pooled = d["pooled"]
    ax.plot(pooled["sizes_tokens"], pooled["hit_rate"], label="one pooled cache")
    n = d["fleet"]["replicas"]
    if "split" in d:
        bt = d["trace"]["block_tokens"]
        ax.plot([s * bt * n for s in d["split"]["sizes_blocks_per_replica"]], d["split"]["hit_rate"],
                label=f"{n} caches split by {d['fleet']['router']}")
    ax.axvline(d["fleet"]["cache_tokens_per_replica"] * n, color="grey", ls="--", lw=1, label="the fleet's KV memory")
    ax.axhline(d["infinite_cache_hit_rate"], color="grey", ls=":", lw=1, label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("total KV cache (tokens)")
    ax.set_ylabel("hit rate (cached / input tokens)")
    ax.set_title(f"miss-ratio curve: {d['trace']['path'].rsplit('/', 1)[-1]}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["DiagnoseParams", "TARGETS", "diagnose", "findings", "plot", "render_text"]
