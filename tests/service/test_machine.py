"""The cores the service counts on: a container's CPU quota caps its CPU affinity (a pod limited to 2
CPUs on a 64-core node starts 1 front end beside the engine and 1 onnxruntime thread, not 63 and
63)."""

from __future__ import annotations

import pytest

from service import machine
from service.settings.link import LinkSettings


def test_cgroup_v2_quota_is_its_quota_over_its_period(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 1.5


def test_cgroup_v2_without_a_quota_has_none(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota_and_its_unlimited_value(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_no_quota(tmp_path):
    assert machine.cgroup_cpu_quota(tmp_path) is None


@pytest.mark.parametrize(("quota", "expected"), [(None, 64), (1.5, 2), (0.2, 1), (100.0, 64)])
def test_usable_cores_is_the_affinity_capped_by_the_quota_rounded_up(monkeypatch, quota, expected):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _: set(range(64)))
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: quota)
    assert machine.usable_cores() == expected


@pytest.mark.parametrize(("quota", "expected"), [(None, 63), (2.0, 1), (0.5, 1), (4.0, 3)])
def test_front_ends_are_one_per_usable_core_but_the_engines(monkeypatch, quota, expected):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _: set(range(64)))
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: quota)
    assert LinkSettings().front_end_count == expected
    assert LinkSettings(workers=2).front_end_count == 2
    assert LinkSettings(workers=0).front_end_count == 0
