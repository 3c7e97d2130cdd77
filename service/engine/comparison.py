"""One (live, candidate) pair's numbers in a shadow trial: what was compared, how the answers differ,
and each version's model time measured as pairs (``MODEL_TIME``); service/engine/shadow.py feeds it,
``GET /models/{name}/shadow`` and the ``vitserve_shadow_*`` series report it."""

from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import Any

import numpy as np

from service.observability.shadow_metrics import ShadowSeries

WINDOW = 100_000  # the latest images (and timed pairs) the p99s and medians are taken over
OUTCOMES = ("compared", "shed", "failed", "timeout", "live_failed", "incompatible")
DIFFERENCE = "per image, the largest |p_live - p_candidate| over its classes"
# The live version runs a shadow batch again only to time it beside the candidate: every batch for
# the first TIMED_FIRST pairs, then one in TIMED_EVERY, so that a long trial does not double its cost.
TIMED_FIRST = 200
TIMED_EVERY = 4
MODEL_TIME = (
    "per timed shadow batch (every one of the first 200, then one in 4), both versions run the same "
    "images at the same batch size, one right after the other (order alternating) on one thread; "
    "ratio_p50 is the median of candidate / live over those pairs"
)


class Comparison:
    """One (live, candidate) pair's numbers, as :func:`Comparison.report` answers them."""

    def __init__(self, model: str, live: int, candidate: int, series: ShadowSeries) -> None:
        self.live, self.candidate = live, candidate
        labels = (model, str(live), str(candidate))
        self._labels = labels
        self._series = series
        self._outcome = {o: series.requests.labels(*labels, o) for o in OUTCOMES}
        self._images = series.images.labels(*labels)
        self._agreements = series.agreements.labels(*labels)
        self._difference = series.difference.labels(*labels)
        self._latency = {r: series.latency.labels(*labels, r) for r in ("live", "candidate")}
        self.outcomes: Counter[str] = Counter()
        self.images = 0
        self.agreements = 0
        self.difference_sum = 0.0
        self.differences: deque[float] = deque(maxlen=WINDOW)
        self.model_s: dict[str, deque[float]] = {
            "live": deque(maxlen=WINDOW),
            "candidate": deque(maxlen=WINDOW),
        }
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.untimed = 0  # shadow batches run since the last timed pair
        self.confusion: Counter[tuple[int, int]] = Counter()

    def count(self, outcome: str, requests: int = 1) -> None:
        self.outcomes[outcome] += requests
        self._outcome[outcome].inc(requests)

    def add(self, live: np.ndarray, candidate: np.ndarray) -> None:
        """One request compared: both versions' probabilities of its images."""
        live_top, candidate_top = live.argmax(axis=1), candidate.argmax(axis=1)
        differences = np.abs(live - candidate).max(axis=1)
        agreeing = int((live_top == candidate_top).sum())
        self.count("compared")
        self.images += len(live)
        self.agreements += agreeing
        self._images.inc(len(live))
        self._agreements.inc(agreeing)
        for difference in differences.tolist():
            self.difference_sum += difference
            self.differences.append(difference)
            self._difference.observe(difference)
        for pair in zip(live_top.tolist(), candidate_top.tolist(), strict=True):
            self.confusion[pair] += 1
            self._series.confusion.labels(*self._labels, *map(str, pair)).inc()

    def timed(self, live_s: float, candidate_s: float) -> None:
        """One shadow batch's model time on each version, measured as a pair (``MODEL_TIME``)."""
        for role, seconds in (("live", live_s), ("candidate", candidate_s)):
            self.model_s[role].append(seconds)
            self._latency[role].observe(seconds)
        if live_s > 0:
            self.ratios.append(candidate_s / live_s)

    def time_next(self) -> bool:
        """Whether the next shadow batch runs on the live version too, to be timed beside the
        candidate (``TIMED_FIRST``, ``TIMED_EVERY``)."""
        timed = len(self.ratios) < TIMED_FIRST or self.untimed >= TIMED_EVERY - 1
        self.untimed = 0 if timed else self.untimed + 1
        return timed

    def report(self) -> dict[str, Any]:
        compared = self.outcomes["compared"]
        differences = np.array(self.differences)
        times = {role: np.array(values) * 1000 for role, values in self.model_s.items()}

        def percentile(values: np.ndarray, q: float) -> float | None:
            return float(np.percentile(values, q)) if len(values) else None

        return {
            "live_version": self.live,
            "candidate_version": self.candidate,
            "requests_compared": compared,
            "images_compared": self.images,
            "top1_agreement": self.agreements / self.images if self.images else None,
            "probability_difference": {
                "definition": DIFFERENCE,
                "mean": self.difference_sum / self.images if self.images else None,
                "p99": percentile(differences, 99),
            },
            "model_ms": {
                "definition": MODEL_TIME,
                "pairs": len(self.ratios),
                "live_p50": percentile(times["live"], 50),
                "live_p99": percentile(times["live"], 99),
                "candidate_p50": percentile(times["candidate"], 50),
                "candidate_p99": percentile(times["candidate"], 99),
                "ratio_p50": statistics.median(self.ratios) if self.ratios else None,
            },
            "confusion": [
                {"live_class": live, "candidate_class": candidate, "images": images}
                for (live, candidate), images in sorted(self.confusion.items())
            ],
            "outcomes": {outcome: self.outcomes[outcome] for outcome in OUTCOMES},
        }
