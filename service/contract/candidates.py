"""Which version answers an unversioned request when a model tries a candidate version on live traffic.

Shared by the engine (the live version its shadow compares against) and the front ends (the canary's
choice), which import nothing heavy: no protobuf, no onnxruntime; and the verdict on a candidate's
evidence (``judge``), the same for the engine's poll-mode promotion and ``python -m service.promote``. The parameters that set it are read
in ``service/contract/candidate_plan.py`` (:class:`~service.contract.candidate_plan.CandidatePlan`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.contract.model_repository import ModelMetadata, rows_fields, rows_id

# The header a client names itself with, so that the canary answers it from one version every time.
CLIENT_KEY_HEADER = "x-client-key"


def live_version(ready: Sequence[int], pinned: int | None, candidate: int | None) -> int | None:
    """The version unversioned requests get: the pinned one when it is ready, else the newest ready
    version other than the candidate, else the candidate (it is all there is)."""
    if pinned in ready:
        return pinned
    others = [v for v in ready if v != candidate]
    if others:
        return max(others)
    return max(ready) if ready else None


# How a candidate's shadow gets its rows: "same" (a copy of the live version's rows: both take the same
# rows), "own" (the front end prepares the candidate's own rows from the same images: another input or
# preprocessing), "none" (the two cannot be compared: other labels).
RowsPlan = Literal["same", "own", "none"]


def shadow_rows(live: ModelMetadata, candidate: ModelMetadata) -> tuple[RowsPlan, str]:
    """How ``candidate`` is shadowed against ``live``, and why, in words for the log and the report."""
    if live.labels != candidate.labels:
        if len(live.labels) != len(candidate.labels):
            why = f"{len(candidate.labels)} classes against {len(live.labels)}"
        else:
            first = next(
                i
                for i, (a, b) in enumerate(zip(live.labels, candidate.labels, strict=True))
                if a != b
            )
            why = f"class {first} is {candidate.labels[first]!r} against {live.labels[first]!r}"
        return "none", f"the candidate has other labels ({why}); its answers cannot be compared"
    if rows_id(live) == rows_id(candidate):
        return "same", "both versions take the same rows"
    live_rows, candidate_rows = rows_fields(live), rows_fields(candidate)
    differences = [
        f"{key} {candidate_rows.get(key)} against {live_rows.get(key)}"
        for key in sorted(set(live_rows) | set(candidate_rows))
        if live_rows.get(key) != candidate_rows.get(key)
    ]
    return "own", "the candidate runs on its own rows (" + "; ".join(differences) + ")"


def in_canary(percent: float, client_key: str | None) -> bool:
    """Whether an unversioned request goes to the candidate: for a client key, always the same answer
    (its SHA-256 read as a fraction in [0, 1)); without one, a random draw."""
    if percent <= 0:
        return False
    if percent >= 100:
        return True
    if client_key is None:
        draw = random.random()
    else:
        digest = hashlib.sha256(client_key.encode("utf-8", "surrogateescape")).digest()
        draw = int.from_bytes(digest[:8], "big") / 2**64
    return draw * 100 < percent


@dataclass(frozen=True)
class Thresholds:
    min_agreement: float
    min_requests: int
    max_latency_ratio: float
    max_p99_difference: float | None = None


@dataclass(frozen=True)
class Verdict:
    action: str  # "promote", "rollback" or "wait"
    reasons: list[str]
    summary: str  # the numbers it was decided on


def judge(report: dict[str, Any], thresholds: Thresholds) -> Verdict:
    """The decision on ``report`` (``GET /models/{name}/shadow``) for its current pair."""
    live, candidate = report["live_version"], report["candidate_version"]
    if candidate is None:
        raise ValueError(f"model {report['model']!r} has no candidate version to decide on")
    pair = next(
        (
            p
            for p in report["pairs"]
            if (p["live_version"], p["candidate_version"]) == (live, candidate)
        ),
        None,
    )
    compared = pair["requests_compared"] if pair else 0
    agreement = pair["top1_agreement"] if pair else None
    p99 = pair["probability_difference"]["p99"] if pair else None
    ratio = pair["model_ms"]["ratio_p50"] if pair else None
    timed = pair["model_ms"].get("pairs", 0) if pair else 0
    summary = (
        f"{report['model']}: candidate version {candidate} against live version {live}: "
        f"{compared} requests compared (min {thresholds.min_requests}), top-1 agreement "
        f"{_number(agreement)} (min {thresholds.min_agreement:g}), p99 probability difference "
        f"{_number(p99)}"
        + (
            f" (max {thresholds.max_p99_difference:g})"
            if thresholds.max_p99_difference is not None
            else ""
        )
        + f", model time ratio {_number(ratio)} over {timed} timed pairs "
        f"(max {thresholds.max_latency_ratio:g})"
    )
    if report.get("comparable") is False:
        return Verdict("wait", [f"{compared} compared: {report['why']}"], summary)
    if compared < thresholds.min_requests:
        return Verdict("wait", [f"only {compared} of {thresholds.min_requests} requests"], summary)
    misses = []
    if agreement is None or agreement < thresholds.min_agreement:
        misses.append(f"top-1 agreement {_number(agreement)} < {thresholds.min_agreement:g}")
    if thresholds.max_p99_difference is not None and (
        p99 is None or p99 > thresholds.max_p99_difference
    ):
        misses.append(f"p99 difference {_number(p99)} > {thresholds.max_p99_difference:g}")
    if ratio is None or ratio > thresholds.max_latency_ratio:
        misses.append(f"model time ratio {_number(ratio)} > {thresholds.max_latency_ratio:g}")
    return Verdict("rollback" if misses else "promote", misses, summary)


def _number(value: float | None) -> str:
    return "none" if value is None else f"{value:.4f}"
