"""Shared fixtures: every test that takes `impl` runs once per implementation.

HYPOTHESIS_PROFILE picks the hypothesis budget: `ci` (the default), `dev` (quick) or
`thorough` (20x ci, for hunting).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
    print_blob=True,
)
settings.register_profile("dev", max_examples=30, stateful_step_count=20, deadline=None)
settings.register_profile(
    "thorough",
    max_examples=4000,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

IMPLEMENTATIONS = ("native", "reference")


def load_impl(name: str):
    """The module behind one implementation: kvroute._native or kvroute.reference."""
    if name == "native":
        return importlib.import_module("kvroute._native")
    return importlib.import_module("kvroute.reference")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    """kvroute._native or kvroute.reference; the same test runs against both."""
    return load_impl(request.param)


@pytest.fixture
def gil_released():
    """Every native call releases the GIL whatever its size (cpp/bindings/gil.hpp keeps it for
    short calls), so that a threaded test's threads run native code at once: what
    ThreadSanitizer checks."""
    mod = load_impl("native")
    mod._release_gil_always(True)
    yield
    mod._release_gil_always(False)


@pytest.fixture
def native():
    return load_impl("native")


@pytest.fixture
def reference():
    return load_impl("reference")


@pytest.fixture(autouse=True)
def _close_openai_clients():
    """Close the openai clients a test opened through gateway_harness.openai_client."""
    yield
    harness = sys.modules.get("tests.gateway_harness") or sys.modules.get("gateway_harness")
    if harness is not None:
        harness.close_openai_clients()
