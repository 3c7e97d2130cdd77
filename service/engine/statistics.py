"""Triton's statistics extension: what each model version's requests and batches cost.

Counted per request (one pipeline call: a ``/predict``, ``/attention`` or infer request): ``success``
and ``fail`` (count, and the nanoseconds from entering the pipeline to the answer), and, for each
request that succeeded, ``queue`` (its images' longest wait from entering the queue to the start of
their batch) and ``compute_input`` / ``compute_infer`` / ``compute_output`` (stacking the batch, the
onnxruntime run, splitting the rows back out; the sum over the batches its images ran in). Counted per
batch: ``execution_count``, ``inference_count`` (images run) and ``batch_stats`` per batch size.
``last_inference`` is the wall-clock time of the last batch in milliseconds since the epoch.

A pipeline owns one; everything is recorded on the event loop, so no lock is needed. The JSON shape
is Triton's (``GET /v2/models/stats``), the field names those of its ``ModelStatistics`` protobuf.
The same numbers feed Triton's ``nv_inference_*`` Prometheus series, when given
(``Metrics.triton_series``), in microseconds as Triton's. They are written by :meth:`publish`, not per
request: in multiprocess mode each Prometheus write is a locked write to a file in shared memory, six
a request, and Triton too refreshes these series on an interval. The engine publishes when a front end
serves ``/metrics`` (the ``metrics`` control call), so a scrape reads the numbers of that moment.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Duration:
    """Triton's ``StatisticDuration``: how many, and their nanoseconds together."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(frozen=True, eq=False)
class BatchTimes:
    """What one batch took, in nanoseconds: stacking its rows, the model run, splitting the rows."""

    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


@dataclass
class _BatchSizeStats:
    """The batches of one size: how many, and their three stages' nanoseconds together."""

    count: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class _Series(Protocol):  # a prometheus-client metric with its labels set
    def inc(self, amount: float = 1) -> None: ...


class ModelStatistics:
    def __init__(self, series: dict[str, _Series] | None = None) -> None:
        self._series = series or {}
        self.durations = {stage: Duration() for stage in STAGES}
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self._batches: dict[int, _BatchSizeStats] = {}
        self._published: dict[str, float] = {}  # the totals the series were last given

    # recorded once a batch and once a request, each in one call (no call per number: they are
    # on every request's way)

    def record_batch(self, size: int, times: BatchTimes) -> None:
        """A batch of ``size`` images ran."""
        self.execution_count += 1
        self.inference_count += size
        self.last_inference_ms = time.time_ns() // 1_000_000
        stats = self._batches.get(size)
        if stats is None:
            stats = self._batches[size] = _BatchSizeStats()
        stats.count += 1
        stats.compute_input_ns += times.compute_input_ns
        stats.compute_infer_ns += times.compute_infer_ns
        stats.compute_output_ns += times.compute_output_ns

    def record_request(
        self, queue_ns: int, batches: Iterable[BatchTimes], succeeded: bool, ns: int
    ) -> None:
        """A request's images all ran: its wait in the queue, the batches they ran in, and its
        outcome (``succeeded``, or failed: a non-finite output) after ``ns``."""
        compute_input = compute_infer = compute_output = 0
        for times in batches:
            compute_input += times.compute_input_ns
            compute_infer += times.compute_infer_ns
            compute_output += times.compute_output_ns
        durations = self.durations
        for stage, stage_ns in (
            ("queue", queue_ns),
            ("compute_input", compute_input),
            ("compute_infer", compute_infer),
            ("compute_output", compute_output),
            ("success" if succeeded else "fail", ns),
        ):
            duration = durations[stage]
            duration.count += 1
            duration.ns += stage_ns

    def record_outcome(self, succeeded: bool, ns: int) -> None:
        """A request left the pipeline, answered (``succeeded``) or with an error, after ``ns``."""
        self.durations["success" if succeeded else "fail"].add(ns)

    def publish(self) -> None:
        """Add to the ``nv_inference_*`` series what they have not been given yet (added, not set:
        a version loaded again goes on from the series' last values, as Triton's counters)."""
        success, fail = self.durations["success"], self.durations["fail"]
        totals = {
            "request_success": success.count,
            "request_failure": fail.count,
            "count": self.inference_count,
            "exec_count": self.execution_count,
            "request_duration_us": (success.ns + fail.ns) / 1000,
            **{f"{s}_duration_us": self.durations[s].ns / 1000 for s in STAGES[2:]},
        }
        for key, series in self._series.items():
            if totals[key] != self._published.get(key, 0):
                series.inc(totals[key] - self._published.get(key, 0))
                self._published[key] = totals[key]

    def as_dict(self, name: str, version: str) -> dict[str, Any]:
        """One entry of Triton's ``model_stats``."""
        inference_stats = {stage: self.durations[stage].as_dict() for stage in STAGES}
        inference_stats["cache_hit"] = Duration().as_dict()  # no response cache here
        inference_stats["cache_miss"] = Duration().as_dict()
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": inference_stats,
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": stats.count, "ns": stats.compute_input_ns},
                    "compute_infer": {"count": stats.count, "ns": stats.compute_infer_ns},
                    "compute_output": {"count": stats.count, "ns": stats.compute_output_ns},
                }
                for size, stats in sorted(self._batches.items())
            ],
            "memory_usage": [],
        }
