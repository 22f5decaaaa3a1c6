"""Simulated CPU devices: `force_cpu_devices` asks XLA's host platform for a device count. It must
run before JAX initialises a backend; it and `launch_pinned_ranks` (one device per rank process) are
the only places the experiments touch ``XLA_FLAGS``.
"""

from __future__ import annotations

import os

#: XLA's flag for the host platform's device count.
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(count: int, *, cpu_only: bool = False) -> None:
    """Asks XLA's host platform for ``count`` devices (a no-op if ``XLA_FLAGS`` already names a
    count, so a caller's choice wins). ``cpu_only`` also pins JAX to the CPU platform unless
    ``JAX_PLATFORMS`` is set. Only the host platform reads the flag: on a GPU it changes nothing."""
    if count < 1:
        raise ValueError(f"cpu device count must be >= 1, got {count}")
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
