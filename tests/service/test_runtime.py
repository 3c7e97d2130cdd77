"""How many onnxruntime threads a session gets: the setting, else the cores but one shared out."""

from __future__ import annotations

import pytest

from service.engine import runtime
from service.settings import Settings


@pytest.mark.parametrize(
    ("cores", "instances", "threads"),
    [(1, 1, 1), (2, 1, 1), (2, 2, 1), (8, 1, 7), (8, 2, 3), (8, 16, 1), (16, 3, 5)],
)
def test_intra_op_threads_leave_a_core_to_the_event_loop(monkeypatch, cores, instances, threads):
    monkeypatch.setattr(runtime, "usable_cores", lambda: cores)
    assert runtime.intra_op_threads(Settings(), instances) == threads


def test_an_explicit_thread_count_wins(monkeypatch):
    monkeypatch.setattr(runtime, "usable_cores", lambda: 8)
    assert runtime.intra_op_threads(Settings(intra_op_threads=3), 4) == 3
