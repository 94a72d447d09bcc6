"""Implementation selection through KVROUTE_IMPLEMENTATION."""

from __future__ import annotations

import os
import subprocess
import sys


def _implementation_with(value: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("KVROUTE_IMPLEMENTATION", None)
    if value is not None:
        env["KVROUTE_IMPLEMENTATION"] = value
    return subprocess.run(
        [sys.executable, "-c", "import kvroute; print(kvroute.implementation)"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_default_is_native():
    proc = _implementation_with(None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "native"


def test_python_selects_reference():
    proc = _implementation_with("python")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "python"


def test_unknown_value_is_a_clear_error():
    proc = _implementation_with("fortran")
    assert proc.returncode != 0
    assert "KVROUTE_IMPLEMENTATION='fortran'" in proc.stderr
