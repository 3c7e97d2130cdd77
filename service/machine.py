"""What this machine lets the service use: the cores of its CPU affinity, within its container's CPU quota.

Read by the settings (one front end per usable core) and the engine (onnxruntime's threads).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs a container's cgroup allows (cgroup v2 ``cpu.max``, or v1's CFS quota); None when
    there is no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by its container's CPU quota (a pod
    limited to 2 CPUs on a 64-core node has 2, not 64)."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores
