"""What a simulated run measured, computed from per-request records.

Definitions (the seed's "Evals" section):

- hit rate = cached input tokens / total input tokens, over all requests (a token-weighted
  ratio, not a fraction of requests).
- TTFT = first-token time - arrival time: waiting for admission (token budget, KV memory,
  max_num_seqs), the request's own prefill chunks, and the steps it shares with others.
  Percentiles use numpy's default linear interpolation.
- cold-start TTFT: the same over the first turns of sessions only (a single-turn
  workload's requests are all first turns).
- prefill seconds: compute time of the uncached prompt tokens (uncached x per_token_s)
  per request, summed per replica. busiest/mean = max over replicas / mean over
  replicas; fleet prefill = the sum.
- rebinds and stranded blocks: as the router's decisions reported them.
- predicted hit rate: what the router believed it would save (Decision.cached_tokens),
  against which `hit_rate` shows the cost of stale or approximate knowledge.
- arrival rate = requests / (last arrival - first arrival), per second.
- throughput = output tokens / makespan (tokens per second, the whole fleet);
  request throughput = requests / makespan.
- TPOT (time per output token) of a request with n > 1 output tokens =
  (completion - first token) / (n - 1); mean and p90 over those requests.
- preemptions: requests the engines preempted (recompute), summed over replicas.
- rejected: requests longer than an engine's KV memory, refused at arrival and left out
  of every other statistic (requests counts the served ones).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; nan when empty."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan
    return float(np.percentile(values, q))


@dataclass(frozen=True)
class Metrics:
    """The numbers of one simulated run (see the module docstring for definitions)."""

    requests: int
    input_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    cold_requests: int
    cold_ttft_mean: float
    cold_ttft_p90: float
    replica_prefill_s: tuple[float, ...]
    fleet_prefill_s: float
    busiest_over_mean: float
    rebinds: int
    stranded_blocks: int
    predicted_hit_rate: float
    makespan_s: float
    arrival_rate: float = math.nan
    throughput_tok_s: float = math.nan
    throughput_req_s: float = math.nan
    tpot_mean: float = math.nan
    tpot_p90: float = math.nan
    preemptions: int = 0
    rejected: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values; nan (an empty run) becomes None."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float) and math.isnan(value):
                out[key] = None
            elif isinstance(value, tuple):
                out[key] = list(value)
        return out


def compute(
    *,
    prompt_tokens: np.ndarray,
    cached_tokens: np.ndarray,
    ttft: np.ndarray,
    first_turn: np.ndarray,
    replica: np.ndarray,
    prefill_s: np.ndarray,
    num_replicas: int,
    rebinds: int = 0,
    stranded_blocks: int = 0,
    predicted_cached_tokens: np.ndarray | None = None,
    makespan_s: float = 0.0,
    arrival: np.ndarray | None = None,
    finish: np.ndarray | None = None,
    output_tokens: np.ndarray | None = None,
    preemptions: int = 0,
    rejected: int = 0,
) -> Metrics:
    """Metrics from per-request arrays (one entry per completed request)."""
    prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
    cached_tokens = np.asarray(cached_tokens, dtype=np.int64)
    ttft = np.asarray(ttft, dtype=np.float64)
    first_turn = np.asarray(first_turn, dtype=bool)
    replica = np.asarray(replica, dtype=np.int64)
    prefill_s = np.asarray(prefill_s, dtype=np.float64)
    total = int(prompt_tokens.sum())
    cached = int(cached_tokens.sum())
    per_replica = np.bincount(replica, weights=prefill_s, minlength=num_replicas).astype(np.float64)
    mean_replica = float(per_replica.mean()) if num_replicas else 0.0
    predicted = 0 if predicted_cached_tokens is None else int(np.asarray(predicted_cached_tokens).sum())
    cold = ttft[first_turn]
    rate = tput = rtput = tpot_mean = tpot_p90 = math.nan
    if arrival is not None and ttft.size > 1:
        arrival = np.asarray(arrival, dtype=np.float64)
        span = float(arrival.max() - arrival.min())
        rate = (ttft.size - 1) / span if span > 0 else math.inf
    if output_tokens is not None and makespan_s > 0:
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        tput = float(output_tokens.sum()) / makespan_s
        rtput = ttft.size / makespan_s
    if finish is not None and output_tokens is not None and arrival is not None:
        many = np.asarray(output_tokens) > 1
        first = np.asarray(arrival, dtype=np.float64) + ttft
        tpot = (np.asarray(finish, dtype=np.float64)[many] - first[many]) / (np.asarray(output_tokens)[many] - 1)
        if tpot.size:
            tpot_mean, tpot_p90 = float(tpot.mean()), percentile(tpot, 90)
    return Metrics(
        requests=int(ttft.size),
        input_tokens=total,
        cached_tokens=cached,
        hit_rate=cached / total if total else math.nan,
        ttft_mean=float(ttft.mean()) if ttft.size else math.nan,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        cold_requests=int(cold.size),
        cold_ttft_mean=float(cold.mean()) if cold.size else math.nan,
        cold_ttft_p90=percentile(cold, 90),
        replica_prefill_s=tuple(float(x) for x in per_replica),
        fleet_prefill_s=float(per_replica.sum()),
        busiest_over_mean=float(per_replica.max()) / mean_replica if mean_replica > 0 else math.nan,
        rebinds=int(rebinds),
        stranded_blocks=int(stranded_blocks),
        predicted_hit_rate=predicted / total if total else math.nan,
        makespan_s=float(makespan_s),
        arrival_rate=rate,
        throughput_tok_s=tput,
        throughput_req_s=rtput,
        tpot_mean=tpot_mean,
        tpot_p90=tpot_p90,
        preemptions=int(preemptions),
        rejected=int(rejected),
    )


__all__ = ["Metrics", "compute", "percentile"]
