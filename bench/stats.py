"""Medians with their spread, the timing loop of in-process measurements, and numbers for tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements, with their minimum, maximum and count."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        """None when no value was measured (missing values are dropped)."""
        kept = [float(v) for v in values if v is not None]
        if not kept:
            return None
        return cls(statistics.median(kept), min(kept), max(kept), len(kept))

    def text(self, digits: int = 0) -> str:
        """``median (low-high)``, or the median alone for a single measurement."""
        if self.n < 2:
            return fmt(self.median, digits)
        return f"{fmt(self.median, digits)} ({fmt(self.low, digits)}-{fmt(self.high, digits)})"


def spread_text(spread: Spread | None, digits: int = 0) -> str:
    return spread.text(digits) if spread else "-"


def median(spread: Spread | None) -> float | None:
    return spread.median if spread else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: float | None, digits: int = 0) -> str:
    """Thousands separators; a dash for a value not measured."""
    return "-" if value is None else f"{value:,.{digits}f}"


def rate(
    run: Callable[[], object], items_per_call: int, min_time_s: float, min_calls: int = 3
) -> float:
    """Items per second of ``run``, called until both ``min_time_s`` and ``min_calls`` are met."""
    calls = 0
    started = time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - started
        if calls >= min_calls and elapsed >= min_time_s:
            return items_per_call * calls / elapsed


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def alternated(items: Sequence[T], repeat: int) -> list[T]:
    """The order of ``items`` in repeat number ``repeat``: as given in even repeats, reversed in odd
    ones, so that a machine's drift over a run falls on every item alike."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))
