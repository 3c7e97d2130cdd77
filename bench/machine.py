"""What machine the numbers come from, and whether something else was using it.

The busy check samples /proc/stat and every /proc/PID/stat twice: how many cores were busy in total,
and which processes used them. Run it while the servers under test are idle (between load runs); then
anything busy that is not ours is someone else.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from export.hardware import cpu_model

# More than this many cores used by other processes while ours are idle: the machine was not quiet.
BUSY_CORES_THRESHOLD = 0.25
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_cpu_line(stat_text: str) -> tuple[int, int]:
    """(busy jiffies, total jiffies) from the aggregate ``cpu`` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            # user nice system idle iowait irq softirq steal; guest is counted in user already.
            fields = [int(v) for v in line.split()[1:9]]
            return sum(fields) - fields[3] - fields[4], sum(fields)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_pid_stat(text: str) -> tuple[str, int]:
    """(command name, utime + stime in clock ticks) of /proc/PID/stat; the name may hold ') '."""
    start, end = text.index("("), text.rindex(")")
    rest = text[end + 2 :].split()  # rest[0] is field 3 (state); utime, stime are fields 14, 15
    return text[start + 1 : end], int(rest[11]) + int(rest[12])


def _stats(directory: str) -> dict[int, tuple[str, int]]:
    found = {}
    for entry in os.scandir(directory):
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = parse_pid_stat(Path(entry.path, "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
    return found


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU clock ticks used so far by each thread of ``pid``, by thread id."""
    return {tid: ticks for tid, (_, ticks) in _stats(f"/proc/{pid}/task").items()}


@dataclass(frozen=True)
class Snapshot:
    at: float
    cpu: tuple[int, int]
    processes: dict[int, tuple[str, int]]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            time.monotonic(), parse_cpu_line(Path("/proc/stat").read_text()), _stats("/proc")
        )


@dataclass(frozen=True)
class User:
    pid: int
    name: str
    cores: float
    ours: bool
    cmd: str = ""


@dataclass(frozen=True)
class BusyCheck:
    busy_cores: float  # every process, ours included
    other_cores: float  # processes that are not ours
    busy: bool
    top: list[User] = field(default_factory=list)

    def describe(self) -> str:
        users = ", ".join(
            f"{u.cmd or u.name} ({u.cores:.2f} cores{', ours' if u.ours else ''})" for u in self.top
        )
        return f"{self.busy_cores:.2f} cores busy, {self.other_cores:.2f} not ours; top: {users or '-'}"


def usage(before: Snapshot, after: Snapshot, own_pids: set[int]) -> list[User]:
    """Cores each process used between the snapshots, most first (a pid whose name changed in
    between is a new process and is left out)."""
    seconds = max(after.at - before.at, 1e-9)
    users = []
    for pid, (name, ticks) in after.processes.items():
        if pid in before.processes and before.processes[pid][0] == name:
            cores = (ticks - before.processes[pid][1]) / CLOCK_TICKS / seconds
            if cores > 0.005:
                users.append(User(pid, name, round(cores, 3), pid in own_pids))
    return sorted(users, key=lambda user: -user.cores)


def judge(
    before: Snapshot,
    after: Snapshot,
    own_pids: set[int],
    cpus: int,
    threshold: float = BUSY_CORES_THRESHOLD,
    cmdline: Callable[[int], str] = lambda pid: "",
) -> BusyCheck:
    """Busy when processes other than ``own_pids`` used more than ``threshold`` cores."""
    jiffies = after.cpu[1] - before.cpu[1]
    total = cpus * (after.cpu[0] - before.cpu[0]) / jiffies if jiffies > 0 else 0.0
    users = usage(before, after, own_pids)
    others = max(0.0, total - sum(user.cores for user in users if user.ours))
    top = [User(u.pid, u.name, u.cores, u.ours, cmdline(u.pid)) for u in users[:3]]
    return BusyCheck(round(total, 3), round(others, 3), others > threshold, top)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:100]


def busy_check(
    own_pids: set[int] | None = None,
    interval_s: float = 1.0,
    threshold: float = BUSY_CORES_THRESHOLD,
) -> BusyCheck:
    """Sample the machine for ``interval_s``; this process always counts as ours."""
    before = Snapshot.take()
    time.sleep(interval_s)
    own = set(own_pids or ()) | {os.getpid()}
    return judge(before, Snapshot.take(), own, os.cpu_count() or 1, threshold, _cmdline)


def process_tree(root: int) -> dict[int, int]:
    """``root`` and every process under it (a server's front ends and engine, a tritonserver and its
    stubs), each with the CPU clock ticks it has used so far."""
    ticks = {}
    for pid in [root, *descendants(root)]:
        try:
            ticks[pid] = parse_pid_stat(Path(f"/proc/{pid}/stat").read_text())[1]
        except (OSError, ValueError, IndexError):
            continue
    return ticks


def cores_used(before: dict[int, int], after: dict[int, int], seconds: float) -> float:
    """Cores a process tree used between two :func:`process_tree` readings ``seconds`` apart (a
    process that started in between counts from 0; one that ended in between is lost)."""
    ticks = sum(used - before.get(pid, 0) for pid, used in after.items())
    return ticks / CLOCK_TICKS / seconds if seconds > 0 else 0.0


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


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, theirs, and so on (from /proc; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name, in parentheses, may hold spaces: the fields after it are fixed
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def tree_memory_kib(pid: int) -> dict[str, int | None]:
    """VmRSS and VmHWM summed over a process and its descendants (a server's every process; the sum
    of peaks bounds their peak together from above)."""
    total: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    for member in [pid, *descendants(pid)]:
        for key, value in process_memory_kib(member).items():
            if value is not None:
                total[key] = (total[key] or 0) + value
    return total


def _first_line(path: str, prefix: str) -> str | None:
    try:
        return next(
            (line for line in Path(path).read_text().splitlines() if line.startswith(prefix)),
            None,
        )
    except OSError:
        return None


def machine_rows(packages: tuple[str, ...]) -> list[list[str]]:
    """The machine and the versions of what was measured, as rows of a two-column table."""
    memory = _first_line("/proc/meminfo", "MemTotal:")
    os_name = _first_line("/etc/os-release", "PRETTY_NAME=")
    versions = {"python": sys.version.split()[0]}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    usable = len(os.sched_getaffinity(0))
    return [
        ["CPU", f"{cpu_model()} ({os.cpu_count()} logical CPUs, {usable} usable)"],
        ["memory", f"{int(memory.split()[1]) / 2**20:.1f} GiB" if memory else "-"],
        [
            "OS",
            f"{os_name.split('=', 1)[1].strip(chr(34)) if os_name else platform.platform()}, "
            f"kernel {platform.release()}",
        ],
        ["versions", ", ".join(f"{k} {v}" for k, v in versions.items())],
    ]
