"""Prometheus metrics, one registry per app (so tests and several apps in one process never collide).

Under ``python -m service`` with front-end processes, prometheus-client's multiprocess mode sums every
process's values (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor): each gauge says how (the engine
alone sets the model gauges, so the largest live value is the engine's).

Triton's split: time in the queue versus time in the model; average batch size is
``vitserve_batch_size_sum / vitserve_batch_size_count`` (images per model execution).

Beside vitserve's own: prometheus-client's process and platform collectors (``process_*``: memory,
CPU, open files; ``python_info``), and Triton's ``nv_inference_*`` series per model version, under
Triton's names and labels, so that dashboards made for Triton chart vitserve (docs/ecosystem.md).
They only ever grow, as Triton's counters; they are declared as gauges only because prometheus-client
writes a counter as ``<name>_total``, which is not the name Triton's dashboards query. They are fed
by ``service/engine/statistics.py``, from the numbers of Triton's statistics extension.

The multiprocess files are memory-mapped, and prometheus-client makes and grows them sparse: the first
write to a page that a full filesystem cannot back is SIGBUS, the death of the process (front ends
crash-looped on a full TMPDIR). Here each file's space is reserved when it is made or grown
(``posix_fallocate``), so a full filesystem is an OSError at that moment; a value that cannot be
written to its file then lives in its process alone (missing from the sums until there is room),
with a warning in the log, and the request that wrote it goes on. The supervisor folds the files of
a process that ended into one archive file per kind (:func:`retire_process`): counters keep what
ended processes counted, and the directory holds one file per live process and kind, not one per
process ever started.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.mmap_dict import _INITIAL_MMAP_SIZE, MmapedDict

from service.observability.logs import Throttle
from service.observability.shadow_metrics import ShadowSeries

logger = logging.getLogger("vitserve")

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


_BATCH_BUCKETS = tuple(float(2**i) for i in range(11))  # 1 to 1024, the largest max_batch_size
_GRAPH = ["model", "graph"]
_GRPC_CALL = ["grpc_type", "grpc_service", "grpc_method"]
# Triton's nv_inference_* metrics (its docs/user_guide/metrics.md), by the key statistics.py feeds.
TRITON_METRICS = {
    "request_success": "Number of successful inference requests, all batch sizes",
    "request_failure": "Number of failed inference requests, all batch sizes",
    "count": "Number of inferences performed (images run)",
    "exec_count": "Number of model executions performed (batches run)",
    "request_duration_us": "Cumulative inference request duration in microseconds",
    "queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "compute_input_duration_us": "Cumulative compute input duration in microseconds",
    "compute_infer_duration_us": "Cumulative compute inference duration in microseconds",
    "compute_output_duration_us": "Cumulative inference compute output duration in microseconds",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = Counter(
            "vitserve_http_requests",
            "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "vitserve_http_request_duration_seconds",
            "Time from request start to the end of the response, by route template and method.",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # gRPC calls, beside the HTTP requests above, under the names and labels of the gRPC
        # ecosystem's Prometheus interceptors (go-grpc-prometheus, py-grpc-prometheus), which
        # dashboards and alerts written for gRPC servers query (docs/ecosystem.md)
        self.grpc_handled = Counter(
            "grpc_server_handled",
            "gRPC calls answered, by service, method, type and status code (as go-grpc-prometheus).",
            [*_GRPC_CALL, "grpc_code"],
            registry=r,
        )
        self.grpc_handling = Histogram(
            "grpc_server_handling_seconds",
            "Time from a gRPC call's start to its answer, by service, method and type.",
            _GRPC_CALL,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "vitserve_queue_wait_seconds",
            "Time an image waited in the batcher queue before its batch started, by model and graph.",
            _GRAPH,
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "vitserve_compute_seconds",
            "Time one batch spent in onnxruntime, by model and graph.",
            _GRAPH,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "vitserve_batch_size",
            "Images per model execution, by model and graph.",
            _GRAPH,
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "vitserve_queue_depth",
            "Images waiting in the batcher queue, by model and graph.",
            _GRAPH,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inference_failures = Counter(
            "vitserve_inference_failures",
            "Batches whose model run raised an error, by model and graph.",
            _GRAPH,
            registry=r,
        )
        self.non_finite_outputs = Counter(
            "vitserve_non_finite_outputs",
            "Images whose model outputs held NaN or Infinity (answered 500), by model and graph.",
            _GRAPH,
            registry=r,
        )
        self.rejections = Counter(
            "vitserve_rejected_requests",
            "Requests answered 503 by the batcher, by model, graph and reason (queue_full, timeout, "
            "shutting_down).",
            [*_GRAPH, "reason"],
            registry=r,
        )
        self.ready = Gauge(
            "vitserve_ready",
            "1 while the service is ready to serve, else 0.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cancelled = Counter(
            "vitserve_cancelled_images",
            "Queued images dropped before they ran because their client went away, by model and graph.",
            _GRAPH,
            registry=r,
        )
        self.decode_rejections = Counter(
            "vitserve_decode_rejected_requests",
            "Requests answered 503 while waiting for a decode slot, by reason (waiters_full, timeout).",
            ["reason"],
            registry=r,
        )
        self.model_info = Gauge(
            "vitserve_model_info",
            "Each model version being served (value 1), with its execution provider and precision.",
            ["model", "version", "provider", "precision"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_load_seconds = Gauge(
            "vitserve_model_load_seconds",
            "Seconds the last load of a model version took, by phase: load (open and check the "
            "graphs) and warmup.",
            ["model", "version", "phase"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_load_failures = Counter(
            "vitserve_model_load_failures",
            "Model versions that failed to load (the reason is in /v2/repository/index and the log).",
            ["model"],
            registry=r,
        )
        self.triton = {
            key: Gauge(
                f"nv_inference_{key}",
                text,
                ["model", "version"],
                registry=r,
                multiprocess_mode="sum",  # a counter: summed over processes, the ended ones too
            )
            for key, text in TRITON_METRICS.items()
        }
        self.shadow = ShadowSeries(r)

    def triton_series(self, model: str, version: int) -> dict[str, Gauge]:
        """Triton's ``nv_inference_*`` series of one model version, by ``TRITON_METRICS`` key."""
        return {key: gauge.labels(model, str(version)) for key, gauge in self.triton.items()}


def observe_times(histogram: Any, amount: float, times: int) -> None:
    """``histogram.observe(amount)`` ``times`` over (a histogram with its labels set), in two writes
    of its shared values instead of ``2 * times``: prometheus-client's own ``Histogram.observe``
    (0.26), with ``times`` as the weight of the one bucket it adds to."""
    if times == 1:
        histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(times)
            break


def forget_series(gauge: Gauge, *labels: str) -> None:
    """A labelled gauge series that no longer exists: zeroed, and removed where that is possible.
    In multiprocess mode prometheus-client cannot remove a series (it warns each time) and the zero
    stays in the process's file: a zeroed ``livemax`` series says "not served"."""
    gauge.labels(*labels).set(0)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        gauge.remove(*labels)


def exposition(registry: CollectorRegistry) -> bytes:
    """The metrics in Prometheus' text format: this app's, or every process's in multiprocess mode
    (there ``process_*`` describes the front-end process that answers the scrape)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    return generate_latest(registry)


# --- multiprocess files -----------------------------------------------------------------------------

ARCHIVE = "archive"  # in place of a pid: what the processes that ended had counted
# the files whose values are summed over processes, the ended ones too (gauges: livesum, livemax go
# with their process: prometheus-client's mark_process_dead)
_SUMMED = ("counter", "histogram", "gauge_sum")
_WARN_EVERY_S = 60.0


class ReservedDict(MmapedDict):
    """prometheus-client's file of one process's values, with every page reserved before it is
    mapped: a full filesystem raises OSError (ENOSPC) here, never SIGBUS on a later write."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            fd = os.open(filename, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size == 0:
                    os.posix_fallocate(fd, 0, _INITIAL_MMAP_SIZE)
            except OSError:
                if os.fstat(fd).st_size == 0:  # an empty file breaks every scrape: not left
                    os.unlink(filename)
                raise
            finally:
                os.close(fd)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        # an entry: its length (4 bytes), the key padded to 8 bytes, the value and timestamp (16)
        length = len(key.encode("utf-8"))
        size = 4 + length + (8 - (length + 4) % 8) + 16
        while self._used + size > self._capacity:  # grown as prometheus-client grows it, reserved
            os.posix_fallocate(self._f.fileno(), 0, self._capacity * 2)
            self._capacity *= 2
            self._m = mmap.mmap(self._f.fileno(), self._capacity)
        super()._init_value(key)


_UNSHARED = Throttle(_WARN_EVERY_S)  # once a minute in a process


def _report_unshared(error: OSError) -> None:
    """Log, at most once a minute in a process, that values cannot be written to their files."""
    if _UNSHARED.due():
        logger.warning(
            "metrics: cannot write to PROMETHEUS_MULTIPROC_DIR (%s): this process's newest "
            "values are missing from /metrics until there is room",
            error.strerror or error,
        )


def _degrading(shared: type) -> type:
    """A value class that writes through ``shared`` (prometheus-client's file-backed one) and, when
    the file cannot be made or grown, keeps the value in this process instead of failing the
    request that wrote it."""

    class Value:
        _multiprocess = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                self._value = shared(*args, **kwargs)
            except OSError as error:
                _report_unshared(error)
                self._value = values.MutexValue(*args, **kwargs)

        def inc(self, amount: float) -> None:
            try:
                self._value.inc(amount)
            except OSError as error:  # the value is kept in memory; its file had no room
                _report_unshared(error)

        def set(self, value: float, timestamp: float | None = None) -> None:
            try:
                self._value.set(value, timestamp)
            except OSError as error:
                _report_unshared(error)

        def set_exemplar(self, exemplar: Any) -> None:
            self._value.set_exemplar(exemplar)

        def get(self) -> float:
            return self._value.get()

        def get_exemplar(self) -> Any:
            return self._value.get_exemplar()

    return Value


def _share_through_reserved_files() -> None:
    """prometheus-client's multiprocess values, in files whose space is reserved: set before any
    metric of this process is made (every process imports this module before it makes one)."""
    values.MmapedDict = ReservedDict  # type: ignore[attr-defined]
    values.ValueClass = _degrading(values.MultiProcessValue())


if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _share_through_reserved_files()


def retire_process(pid: int, directory: str) -> None:
    """Process ``pid`` has ended: its live gauges go, and its summed values are added to the
    directory's archive files before its own files are removed. (A scrape in the instant between
    the two sees them twice.) Without room for the archive, its files stay, and still count."""
    multiprocess.mark_process_dead(pid, directory)
    for kind in _SUMMED:
        path = os.path.join(directory, f"{kind}_{pid}.db")
        if not os.path.exists(path):
            continue
        try:
            archive = ReservedDict(os.path.join(directory, f"{kind}_{ARCHIVE}.db"))
            try:
                entries = [entry[:3] for entry in MmapedDict.read_all_values_from_file(path)]
                for key, _, _ in entries:  # every entry made first: what can fail adds nothing
                    archive.read_value(key)
                for key, value, timestamp in entries:
                    total, _ = archive.read_value(key)
                    archive.write_value(key, total + value, timestamp)
            finally:
                archive.close()
        except (OSError, RuntimeError) as error:  # RuntimeError: a corrupt file (prometheus-client)
            logger.warning("metrics: cannot fold %s into the archive (%s); it stays", path, error)
            continue
        os.remove(path)
