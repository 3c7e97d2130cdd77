"""The busy-machine check's arithmetic and /proc parsing."""

from __future__ import annotations

import os

from bench.machine import (
    busy_check,
    busy_cores,
    machine_info,
    parse_cpu_line,
    parse_pid_stat,
    process_memory_kib,
)

STAT = """cpu  100 10 50 800 40 0 5 0 0 0
cpu0 50 5 25 400 20 0 2 0 0 0
cpu1 50 5 25 400 20 0 3 0 0 0
intr 12345
"""


def test_cpu_line_busy_excludes_idle_and_iowait():
    busy, total = parse_cpu_line(STAT)
    assert total == 100 + 10 + 50 + 800 + 40 + 0 + 5 + 0
    assert busy == total - 800 - 40


def test_busy_cores_scales_by_cpu_count():
    assert busy_cores((0, 0), (50, 100), cpus=2) == 1.0
    assert busy_cores((10, 100), (10, 200), cpus=2) == 0.0
    assert busy_cores((0, 0), (0, 0), cpus=2) == 0.0  # no time passed


def test_pid_stat_with_spaces_and_parentheses_in_the_name():
    fields = ["S"] + [str(i) for i in range(1, 11)] + ["700", "300"] + ["0"] * 30
    text = "4242 (python (bench) x) " + " ".join(fields)
    assert parse_pid_stat(text) == ("python (bench) x", 1000)


def test_pid_stat_of_this_process_parses():
    with open(f"/proc/{os.getpid()}/stat") as handle:
        name, ticks = parse_pid_stat(handle.read())
    assert name and ticks >= 0


def test_busy_check_reports_and_marks_our_own_processes():
    check = busy_check(own_pids={os.getpid()}, interval_s=0.05, threshold=1e9)
    assert check.busy is False  # an impossible threshold
    assert check.busy_cores >= 0
    assert all({"pid", "name", "cores", "ours", "cmd"} <= set(p) for p in check.top)
    assert "cores busy" in check.describe()


def test_busy_check_flags_other_work_over_the_threshold():
    check = busy_check(interval_s=0.05, threshold=-1.0)  # anything at all counts as busy
    assert check.busy is True


def test_memory_and_machine_info():
    memory = process_memory_kib(os.getpid())
    assert memory["VmRSS"] > 0 and memory["VmHWM"] >= memory["VmRSS"]
    assert process_memory_kib(2**31 - 1) == {"VmRSS": None, "VmHWM": None}
    info = machine_info()
    assert info["logical_cpus"] >= 1 and info["cpu_model"]
