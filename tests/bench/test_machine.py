"""The busy check: /proc parsing, who used the CPUs, and when the machine counts as busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.machine import (
    CLOCK_TICKS,
    Snapshot,
    judge,
    parse_cpu_line,
    parse_pid_stat,
    process_memory_kib,
    thread_ticks,
    usage,
)

STAT = """cpu  100 10 50 800 40 0 5 0 0 0
cpu0 50 5 25 400 20 0 2 0 0 0
intr 12345
"""


def test_cpu_line_busy_excludes_idle_and_iowait():
    busy, total = parse_cpu_line(STAT)
    assert total == 100 + 10 + 50 + 800 + 40 + 0 + 5 + 0
    assert busy == total - 800 - 40


def test_pid_stat_with_spaces_and_parentheses_in_the_name():
    fields = ["S"] + [str(i) for i in range(1, 11)] + ["700", "300"] + ["0"] * 30
    assert parse_pid_stat("4242 (python (bench) x) " + " ".join(fields)) == (
        "python (bench) x",
        1000,
    )


def snapshots(other: int, ours: int, seconds: float = 1.0) -> tuple[Snapshot, Snapshot]:
    """Two CPUs over ``seconds``; pid 10 (not ours) used ``other`` ticks, pid 20 ``ours``."""
    jiffies = int(2 * seconds * 100)
    busy = other + ours
    before = Snapshot(0.0, (0, 0), {10: ("python", 0), 20: ("service", 0), 30: ("old", 5)})
    after = Snapshot(
        seconds, (busy, jiffies), {10: ("python", other), 20: ("service", ours), 30: ("new", 500)}
    )
    return before, after


def test_other_processes_over_the_threshold_make_the_machine_busy():
    half_core = CLOCK_TICKS // 2
    check = judge(*snapshots(other=half_core, ours=0), own_pids={20}, cpus=2, threshold=0.25)
    assert check.busy and check.other_cores == 0.5
    assert [(u.pid, u.cores, u.ours) for u in check.top] == [(10, 0.5, False)]
    assert "0.50 not ours" in check.describe()


def test_our_own_processes_never_make_the_machine_busy():
    full_core = CLOCK_TICKS
    check = judge(*snapshots(other=0, ours=full_core), own_pids={20}, cpus=2, threshold=0.25)
    assert not check.busy and check.busy_cores == 1.0 and check.other_cores == 0.0
    assert check.top[0].ours
    # the same work by someone else is busy; a reused pid (name changed) is not counted at all
    assert judge(*snapshots(other=full_core, ours=0), own_pids=set(), cpus=2).busy
    assert 30 not in {u.pid for u in check.top}


def test_a_spinning_process_is_seen_using_at_most_one_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        before = Snapshot.take()
        time.sleep(0.5)
        after = Snapshot.take()
    finally:
        spinner.kill()
        spinner.wait()
    used = {u.pid: u for u in usage(before, after, own_pids={spinner.pid})}
    assert 0.05 < used[spinner.pid].cores <= 1.1 and used[spinner.pid].ours
    assert os.getpid() not in used or used[os.getpid()].cores < 0.5  # this process slept


def test_memory_and_thread_ticks_of_this_process():
    memory = process_memory_kib(os.getpid())
    assert memory["VmRSS"] > 0 and memory["VmHWM"] >= memory["VmRSS"]
    assert process_memory_kib(2**31 - 1) == {"VmRSS": None, "VmHWM": None}
    ticks = thread_ticks(os.getpid())
    assert os.getpid() in ticks  # the main thread's id is the process id
