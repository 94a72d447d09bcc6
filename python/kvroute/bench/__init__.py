"""kvroute.bench: replay kvroute's workloads against any OpenAI-compatible server.

`kvroute bench --url URL` streams every request of a workload (kvroute.sim.workloads) to
/v1/completions as token ids or to /v1/chat/completions as messages (prompts.py), times
each one (client.py) and prints what a user feels: hit rate from the cached tokens the
server reports, TTFT, TPOT, end-to-end latency, throughput and errors (report.py).
Needs the `bench` extra (aiohttp, rich, matplotlib).
"""

from __future__ import annotations

from .client import APIS, BenchConfig, RequestResult, run
from .report import Summary, plot_ttft, summarize, text_table

__all__ = ["APIS", "BenchConfig", "RequestResult", "Summary", "plot_ttft", "run", "summarize", "text_table"]
