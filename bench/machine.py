"""What machine the numbers come from, and whether something else was using it.

The busy check samples /proc/stat and every /proc/PID/stat over one second: how many cores were busy in
total, and which processes used them. Run it while the servers under test are idle (between load runs);
then anything busy is someone else.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from export.hardware import cpu_model

# More than this many cores busy while nothing of ours runs means the machine was not quiet.
BUSY_CORES_THRESHOLD = 0.25
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_cpu_line(stat_text: str) -> tuple[int, int]:
    """(busy jiffies, total jiffies) from the aggregate ``cpu`` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            # user nice system idle iowait irq softirq steal guest guest_nice; guest is in user already.
            fields = values[:8]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            total = sum(fields)
            return total - idle, total
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def busy_cores(before: tuple[int, int], after: tuple[int, int], cpus: int) -> float:
    """Average number of busy cores between two ``parse_cpu_line`` samples."""
    busy = after[0] - before[0]
    total = after[1] - before[1]
    if total <= 0:
        return 0.0
    return cpus * busy / total


def parse_pid_stat(text: str) -> tuple[str, int]:
    """(command name, utime + stime in clock ticks) from /proc/PID/stat; the name may hold spaces and ')'."""
    start, end = text.index("("), text.rindex(")")
    name = text[start + 1 : end]
    rest = text[end + 2 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    return name, int(rest[11]) + int(rest[12])


def _pid_times() -> dict[int, tuple[str, int]]:
    times = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            times[int(entry.name)] = parse_pid_stat(Path(entry.path, "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return times


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


@dataclass
class BusyCheck:
    busy_cores: float
    loadavg_1m: float
    busy: bool
    top: list[dict] = field(default_factory=list)  # [{"pid", "name", "cores", "ours"}]

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        names = ", ".join(
            f"{p['cmd'] or p['name']} ({p['cores']:.2f} cores{', ours' if p['ours'] else ''})"
            for p in self.top
        )
        return f"{self.busy_cores:.2f} cores busy over 1 s; top: {names or 'nothing'}"


def busy_check(
    own_pids: set[int] | None = None,
    interval_s: float = 1.0,
    threshold: float = BUSY_CORES_THRESHOLD,
) -> BusyCheck:
    """Sample the machine for ``interval_s``; ``busy`` when other processes used over ``threshold`` cores."""
    own_pids = set(own_pids or ()) | {os.getpid()}
    cpus = os.cpu_count() or 1
    stat = Path("/proc/stat")
    cpu_before, pids_before = parse_cpu_line(stat.read_text()), _pid_times()
    time.sleep(interval_s)
    cpu_after, pids_after = parse_cpu_line(stat.read_text()), _pid_times()
    total = busy_cores(cpu_before, cpu_after, cpus)
    usage = []
    for pid, (name, ticks) in pids_after.items():
        if pid in pids_before and pids_before[pid][0] == name:
            used = (ticks - pids_before[pid][1]) / CLOCK_TICKS / interval_s
            if used > 0.005:
                usage.append((used, pid, name))
    usage.sort(reverse=True)
    ours = sum(used for used, pid, _ in usage if pid in own_pids)
    top = [
        {
            "pid": pid,
            "name": name,
            "cmd": _cmdline(pid),
            "cores": round(used, 3),
            "ours": pid in own_pids,
        }
        for used, pid, name in usage[:3]
    ]
    others = max(0.0, total - ours)
    return BusyCheck(
        busy_cores=round(total, 3),
        loadavg_1m=os.getloadavg()[0],
        busy=others > threshold,
        top=top,
    )


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def machine_info() -> dict:
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "kernel": platform.release(),
        "os": _os_release(),
        "niceness": os.nice(0),
    }


def _os_release() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def package_versions(names: tuple[str, ...]) -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def process_memory_kib(pid: int) -> dict[str, int | None]:
    """VmRSS (resident now) and VmHWM (peak resident) of a process, in KiB."""
    values: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in values:
                values[key] = int(line.split()[1])
    except OSError:
        pass
    return values
