"""Medians with their spread, ratios, the timing loop and the table of the benchmarks."""

from __future__ import annotations

import time

import pytest

from bench.stats import Spread, fmt, rate, ratio, spread_text, table


def test_spread_median_low_high_and_count():
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0, 3)
    assert Spread.of([4, 1, 3, 2]).median == 2.5
    assert Spread.of([None, 5.0]) == Spread(5.0, 5.0, 5.0, 1)
    assert Spread.of([]) is None and Spread.of([None]) is None


def test_spread_text():
    assert Spread.of([10, 12, 11]).text() == "11 (10-12)"
    assert Spread.of([1234.5]).text(1) == "1,234.5"
    assert spread_text(None) == "-" and fmt(None) == "-"


def test_ratio_guards_missing_and_zero():
    assert ratio(6.0, 2.0) == 3.0
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0) is None


def test_rate_meets_both_minimums_and_counts_items_per_second():
    calls = []
    assert rate(lambda: calls.append(1), items_per_call=4, min_time_s=0.0, min_calls=5) > 0
    assert len(calls) == 5
    value = rate(lambda: time.sleep(0.01), items_per_call=10, min_time_s=0.05, min_calls=1)
    assert value == pytest.approx(1000, rel=0.5)  # 10 items per ~10 ms


def test_table():
    assert table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
