"""kvroute.diagnose: why a fleet's prefix-cache hit rate is what it is.

- mrc: miss-ratio curves (hit rate vs cache size) of a block stream, pooled and per
  replica, with SHARDS sampling in bounded memory.
- volatile: the volatile-prefix detector (a timestamp or request id at the top of the
  prompt that makes every later block miss).
- stream: block streams read from workloads and trace files.
- report: `kvroute diagnose`, the one-minute report over a trace.
- live: Diagnostics, the same analysis fed request by request (for a gateway).
"""

from __future__ import annotations

from .live import Diagnostics
from .mrc import Curve, Shards, default_sizes, estimate, exact_hit_rate, fleet_hit_rate, per_replica
from .stream import BlockStream, from_workload, read_jsonl

__all__ = ["BlockStream", "Curve", "Diagnostics", "Shards", "default_sizes", "estimate", "exact_hit_rate", "fleet_hit_rate",
           "from_workload", "per_replica", "read_jsonl"]
