"""Medians, spreads and the timing loop of the benchmarks."""

from __future__ import annotations

import pytest

from bench.stats import fmt, fmt_spread, rate, ratio, summarize


def test_summarize_median_min_max():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([4, 1, 3, 2])["median"] == 2.5


def test_summarize_ignores_missing_values_and_handles_none_at_all():
    assert summarize([None, 5.0])["n"] == 1
    assert summarize([]) == {"median": None, "min": None, "max": None, "n": 0}
    assert summarize([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_ratio_guards_missing_and_zero():
    assert ratio(6.0, 2.0) == 3.0
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0) is None


def test_formatting():
    assert fmt(1234.5) == "1,234" or fmt(1234.5) == "1,235"
    assert fmt(None) == "-"
    assert fmt(1.234, 1) == "1.2"
    assert fmt_spread(summarize([10, 12, 11])) == "11 (10-12)"
    assert fmt_spread(summarize([10.0])) == "10"
    assert fmt_spread(summarize([])) == "-"
    assert fmt_spread(None) == "-"


def test_rate_meets_both_minimums():
    calls = []
    value = rate(lambda: calls.append(1), items_per_call=4, min_time_s=0.0, min_calls=5)
    assert len(calls) == 5
    assert value > 0


def test_rate_counts_items_per_second():
    import time

    value = rate(lambda: time.sleep(0.01), items_per_call=10, min_time_s=0.05, min_calls=1)
    assert value == pytest.approx(1000, rel=0.5)  # 10 items per ~10 ms
