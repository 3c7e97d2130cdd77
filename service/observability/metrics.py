"""Prometheus metrics, one registry per app (so tests and several apps in one process never collide).

Under ``python -m service`` with front-end processes, prometheus-client's multiprocess mode sums every
process's values (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor): each gauge says how (the engine
alone sets the model gauges, so the largest live value is the engine's).

Triton's split: time in the queue versus time in the model; average batch size is
``vitserve_batch_size_sum / vitserve_batch_size_count`` (images per model execution).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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


def exposition(registry: CollectorRegistry) -> bytes:
    """The metrics in Prometheus' text format: this app's, or every process's in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)
