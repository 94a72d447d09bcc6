"""Print, per pytest-benchmark group, the median of each implementation and the
reference/native ratio.

    python benchmarks/report.py                        # runs every benchmarks/bench_*.py
    python benchmarks/report.py benchmarks/bench_hashing.py [more files or pytest args]
    python benchmarks/report.py --json results.json    # reads an earlier --benchmark-json
    python benchmarks/report.py --save out.json ...    # runs, keeps the json, prints

A benchmark's implementation is the value of whichever parameter is "native" or
"reference" (e.g. a parametrized `impl`); benchmarks that differ only in that parameter are
paired. Benchmarks without such a parameter are listed with their median alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

IMPLEMENTATIONS = ("native", "reference")
HERE = Path(__file__).resolve().parent


def run_benchmarks(args: list[str], json_path: Path) -> None:
    """Run pytest-benchmark on `args` (default: every bench_*.py here), writing json_path."""
    targets = args or sorted(str(p) for p in HERE.glob("bench_*.py"))
    cmd = [sys.executable, "-m", "pytest", *targets, "--benchmark-only", f"--benchmark-json={json_path}", "-q"]
    print("running:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks failed (exit {proc.returncode}); no report")


def _split(bench: dict[str, Any]) -> tuple[str | None, str]:
    """(implementation or None, the benchmark's name without the implementation)."""
    params = bench.get("params") or {}
    impl_key = next((k for k, v in params.items() if v in IMPLEMENTATIONS), None)
    base = bench["name"].split("[")[0]
    rest = [f"{k}={v}" for k, v in sorted(params.items()) if k != impl_key]
    key = base + (f"[{', '.join(rest)}]" if rest else "")
    return (params[impl_key] if impl_key else None), key


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3f} {unit}"
    return f"{seconds / 1e-9:.1f} ns"


def report(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of {group, benchmark, native, reference, ratio} (medians in seconds); also printed."""
    groups: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for bench in data.get("benchmarks", []):
        impl, key = _split(bench)
        groups[bench.get("group") or "(no group)"][key][impl or "median"] = bench["stats"]["median"]
    rows = []
    machine = data.get("machine_info", {})
    print(f"# {machine.get('cpu', {}).get('brand_raw', 'unknown cpu')}, python {machine.get('python_version', '?')}")
    for group in sorted(groups):
        print(f"\n{group}")
        width = max(len(k) for k in groups[group]) + 2
        print(f"  {'benchmark':<{width}}{'native':>14}{'reference':>14}{'ref/native':>12}")
        for key, medians in sorted(groups[group].items()):
            native, reference = medians.get("native"), medians.get("reference")
            ratio = reference / native if native and reference else None
            if native is None and reference is None:
                native = medians.get("median")
            print(
                f"  {key:<{width}}{_fmt(native):>14}{_fmt(reference):>14}"
                f"{(f'{ratio:.1f}x' if ratio else '-'):>12}"
            )
            rows.append({"group": group, "benchmark": key, "native": native, "reference": reference, "ratio": ratio})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="read this pytest-benchmark json instead of running")
    parser.add_argument("--save", type=Path, help="when running, keep the json here")
    opts, rest = parser.parse_known_args(argv)
    if opts.json:
        data = json.loads(opts.json.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = opts.save or Path(tmp) / "benchmarks.json"
            run_benchmarks(rest, path)
            data = json.loads(path.read_text())
    report(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
