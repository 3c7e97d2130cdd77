"""service/observability/logs.py's Throttle: a recurring condition (a full metrics directory, a failing
shadow candidate) is logged the first time, then at most once per interval."""

from __future__ import annotations

from service.observability import logs
from service.observability.logs import Throttle


def test_a_throttle_is_due_first_then_once_per_interval(monkeypatch):
    clock = iter([1000.0, 1000.5, 1059.9, 1060.0, 1060.1, 1200.0])
    monkeypatch.setattr(logs.time, "monotonic", lambda: next(clock))
    throttle = Throttle(60.0)
    assert [throttle.due() for _ in range(6)] == [True, False, False, True, False, True]


def test_a_throttle_is_due_at_once_even_right_after_boot(monkeypatch):
    monkeypatch.setattr(logs.time, "monotonic", lambda: 3.0)  # a clock younger than the interval
    assert Throttle(60.0).due()
