"""``python -m service.promote``'s decision on a comparison, threshold by threshold."""

from __future__ import annotations

import pytest

from service.promote import Thresholds, judge, parse


def report(compared: int, agreement: float, p99: float, ratio: float, candidate=2) -> dict:
    return {
        "model": "m",
        "live_version": 1,
        "candidate_version": candidate,
        "pairs": [
            {  # an older pair's numbers are never the evidence
                "live_version": 1,
                "candidate_version": 3,
                "requests_compared": 10_000,
                "top1_agreement": 1.0,
                "probability_difference": {"p99": 0.0},
                "model_ms": {"ratio_p50": 1.0},
            },
            {
                "live_version": 1,
                "candidate_version": 2,
                "requests_compared": compared,
                "top1_agreement": agreement,
                "probability_difference": {"p99": p99},
                "model_ms": {"ratio_p50": ratio},
            },
        ],
    }


THRESHOLDS = Thresholds(
    min_agreement=0.99, min_requests=500, max_latency_ratio=1.5, max_p99_difference=0.1
)


@pytest.mark.parametrize(
    ("numbers", "action", "reasons"),
    [
        ((499, 1.0, 0.0, 1.0), "wait", ["only 499 of 500 requests"]),
        ((500, 0.99, 0.1, 1.5), "promote", []),
        ((500, 0.989, 0.1, 1.5), "rollback", ["top-1 agreement 0.9890 < 0.99"]),
        ((500, 1.0, 0.11, 1.5), "rollback", ["p99 difference 0.1100 > 0.1"]),
        ((500, 1.0, 0.0, 1.51), "rollback", ["model time ratio 1.5100 > 1.5"]),
    ],
)
def test_each_threshold_decides(numbers, action, reasons):
    verdict = judge(report(*numbers), THRESHOLDS)
    assert (verdict.action, verdict.reasons) == (action, reasons)
    assert f"{numbers[0]} requests compared (min 500)" in verdict.summary


def test_no_candidate_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no candidate version"):
        judge(report(500, 1.0, 0.0, 1.0, candidate=None), THRESHOLDS)
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--min-agreement", "99", "--min-requests", "5"])
