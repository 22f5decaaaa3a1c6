"""Test setup: 8 simulated CPU devices, forced before jax is imported anywhere; and the rule for
tests that need the real expert-load traces."""

import os

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Set (to anything but "" or "0") where the trace tests must run: CI sets it in ``.ci/run``.
REQUIRE_TRACES_ENV = "ULTRAEP_REQUIRE_TRACES"


def traces_required() -> bool:
    """Whether missing traces fail the trace tests instead of skipping them."""
    return os.environ.get(REQUIRE_TRACES_ENV, "") not in ("", "0")


def skip_without_traces(reason: str):
    """Skips the calling test because the traces are missing, or fails it when
    ``ULTRAEP_REQUIRE_TRACES`` is set (so that CI cannot pass with the trace tests skipped)."""
    if traces_required():
        pytest.fail(f"{reason} ({REQUIRE_TRACES_ENV} is set, so this fails instead of skipping)")
    pytest.skip(reason)
