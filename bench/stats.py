"""Medians with their spread, and the timing loop every in-process benchmark uses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min and max of the repeats (None everywhere when there are none)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def rate(
    run: Callable[[], object], items_per_call: int, min_time_s: float, min_calls: int = 3
) -> float:
    """Items per second of ``run``, calling it until both ``min_time_s`` and ``min_calls`` are met."""
    calls = 0
    started = time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - started
        if calls >= min_calls and elapsed >= min_time_s:
            return items_per_call * calls / elapsed


def per_call_us(run: Callable[[], object], min_time_s: float, min_calls: int = 20) -> float:
    """Microseconds per call of ``run`` (same loop as ``rate``)."""
    return 1e6 / rate(run, 1, min_time_s, min_calls)


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for a table: thousands separators, a dash for missing."""
    if value is None:
        return "-"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def fmt_spread(summary: dict | None, digits: int = 0, scale: float = 1.0) -> str:
    """``median (min-max)``, or the median alone when there was a single repeat."""
    if not summary or summary.get("median") is None:
        return "-"
    median = summary["median"] * scale
    if summary.get("n", 0) < 2:
        return fmt(median, digits)
    low, high = summary["min"] * scale, summary["max"] * scale
    return f"{fmt(median, digits)} ({fmt(low, digits)}-{fmt(high, digits)})"
