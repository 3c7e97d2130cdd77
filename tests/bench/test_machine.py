"""The busy check: /proc parsing, who used the CPUs, and when the machine counts as busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.machine import (
    CLOCK_TICKS,
    Snapshot,
    cores_used,
    judge,
    parse_cpu_line,
    parse_pid_stat,
    process_memory_kib,
    process_tree,
    thread_ticks,
    tree_memory_kib,
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


def test_cores_used_by_a_tree_count_a_new_process_from_zero():
    before = {10: 100, 11: 50}
    after = {10: 100 + CLOCK_TICKS, 11: 50 + CLOCK_TICKS // 2, 12: CLOCK_TICKS // 2}
    assert cores_used(before, after, 2.0) == 1.0
    assert cores_used(before, after, 0.0) == 0.0


def test_the_tree_of_a_process_with_a_child_sums_their_memory():
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert len(tree) == 2 and parent.pid in tree and all(t >= 0 for t in tree.values())
        alone = process_memory_kib(parent.pid)["VmRSS"]
        assert tree_memory_kib(parent.pid)["VmRSS"] > alone
    finally:
        for pid in process_tree(parent.pid):
            os.kill(pid, 9)
        parent.wait()
    assert tree_memory_kib(parent.pid) == {"VmRSS": None, "VmHWM": None}
