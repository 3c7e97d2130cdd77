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
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

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

    def triton_series(self, model: str, version: int) -> dict[str, Gauge]:
        """Triton's ``nv_inference_*`` series of one model version, by ``TRITON_METRICS`` key."""
        return {key: gauge.labels(model, str(version)) for key, gauge in self.triton.items()}


def exposition(registry: CollectorRegistry) -> bytes:
    """The metrics in Prometheus' text format: this app's, or every process's in multiprocess mode
    (there ``process_*`` describes the front-end process that answers the scrape)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    return generate_latest(registry)
