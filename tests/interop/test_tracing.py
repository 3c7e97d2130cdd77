"""OpenTelemetry tracing: off unless an ``OTEL_*`` variable asks for it, and then HTTP and gRPC server
spans with vitserve's own decode, queue and batch spans, read with the SDK's in-memory exporter; and a
real server exporting OTLP to a receiver in this test, its JSON log lines carrying the same trace ids.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from fastapi.testclient import TestClient
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.launcher.local_app import local_app
from service.observability import tracing
from tests.interop.eco_support import ECO, eco_server, grpc_port
from tests.support import MODEL_NAME, free_port, make_settings, run_python, server_env

pytestmark = pytest.mark.timeout(300)


# --- off ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"}, False),
    ],
)
def test_which_variables_turn_tracing_on(environ, on):
    assert tracing.wanted(environ) is on
    assert (tracing.provider_from_environment(environ) is not None) is on


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "'zipkin'"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported",
        ),
    ],
)
def test_what_cannot_be_done_fails_at_start_up(environ, fragment):
    with pytest.raises(tracing.TracingConfigError, match=fragment):
        tracing.provider_from_environment(environ)


def test_off_imports_neither_the_sdk_nor_the_instrumentation(model_repository):
    """With no OTEL_* set, serving requests loads no SDK and no instrumentation module, and the app
    has no tracing middleware."""
    script = """
import sys
from fastapi.testclient import TestClient
from service.observability import tracing
from service.launcher.local_app import local_app
from service.settings import Settings
app = local_app(Settings())
with TestClient(app) as client:
    assert client.post("/predict", json={"images": [{"pixels": [[0] * 28] * 28}]}).status_code == 200
    assert tracing.enter_queue(1) is None  # no tracer left behind
stack = app.middleware_stack
names = []
while stack is not None:
    names.append(type(stack).__name__)
    stack = getattr(stack, "app", None)
print("MIDDLEWARE", names)
print("LOADED", sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.instrumentation", "opentelemetry.exporter"))))
"""
    env = {
        k: v for k, v in server_env(model_repository, 18359).items() if not k.startswith("OTEL_")
    }
    result = run_python(script, env)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout
    assert (
        "OpenTelemetryMiddleware" not in result.stdout
        and "RequestContextMiddleware" in result.stdout
    )


# --- on, in memory --------------------------------------------------------------------------------


@pytest.fixture
def traced(
    model_repository: Path,
) -> Iterator[tuple[TestClient, InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = make_settings(
        model_repository,
        ECO,
        grpc_port=grpc_port(),
        max_queue_delay_ms=400,
        max_batch_size=8,
        idle_dispatch=False,  # the two requests share one batch
    )
    with TestClient(local_app(settings, tracer_provider=provider)) as client:
        yield client, exporter, provider
    assert tracing.enter_queue(1) is None  # the app's tracer goes with the app


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def children(spans: list[ReadableSpan], parent: ReadableSpan, name: str) -> list[ReadableSpan]:
    return [
        span
        for span in named(spans, name)
        if span.parent is not None and span.parent.span_id == parent.context.span_id
    ]


def test_request_spans_and_a_batch_span_linked_to_them(traced, fashion_images):
    client, exporter, _ = traced
    images = fashion_images[:2]

    def predict(index: int) -> int:
        body = {"images": [{"pixels": images[index].tolist()}]}
        return client.post("/predict", json=body).status_code

    with ThreadPoolExecutor(2) as pool:  # both inside one 400 ms batching window
        assert list(pool.map(predict, range(2))) == [200, 200]
    spans = list(exporter.get_finished_spans())
    servers = named(spans, "POST /predict")
    assert len(servers) == 2
    assert all(s.kind == trace.SpanKind.SERVER and s.parent is None for s in servers)
    for server in servers:
        (decode,) = children(spans, server, "vitserve.decode")
        (queue,) = children(spans, server, "vitserve.queue")
        assert decode.context.trace_id == queue.context.trace_id == server.context.trace_id
        assert decode.end_time <= queue.start_time <= queue.end_time <= server.end_time
    (batch,) = named(spans, "vitserve.batch")
    assert batch.parent is None  # a root of its own: it serves both requests
    assert batch.context.trace_id not in {s.context.trace_id for s in servers}
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in servers}
    assert batch.attributes["vitserve.requests"] == 2
    assert (batch.attributes["vitserve.model"], batch.attributes["vitserve.graph"]) == (
        MODEL_NAME,
        "classifier",
    )
    # a queue span ends when its batch starts
    for queue in named(spans, "vitserve.queue"):
        assert queue.end_time <= batch.start_time + 1_000_000


def test_grpc_calls_continue_the_callers_trace(traced, fashion_images):
    client, exporter, provider = traced
    port = client.app.state.settings.server.grpc_port
    tensor = np.zeros((1, 1, 28, 28), np.float32)
    infer_input = triton_grpc.InferInput("images", [1, 1, 28, 28], "FP32")
    infer_input.set_data_from_numpy(tensor)
    with (
        triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as grpc_client,
        provider.get_tracer("test").start_as_current_span("caller") as caller,
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        grpc_client.infer(MODEL_NAME, [infer_input], headers=carrier)
    spans = list(exporter.get_finished_spans())
    (server,) = named(spans, "inference.GRPCInferenceService/ModelInfer")
    assert server.kind == trace.SpanKind.SERVER
    assert server.parent.span_id == caller.get_span_context().span_id
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert children(spans, server, "vitserve.decode") and children(spans, server, "vitserve.queue")
    (batch,) = named(spans, "vitserve.batch")
    assert [link.context.span_id for link in batch.links] == [server.context.span_id]


def test_a_failing_batch_marks_its_span(traced):
    client, exporter, _ = traced
    pipeline = client.app.state.engine.manager.resolve(MODEL_NAME)

    def broken(images: np.ndarray) -> list[np.ndarray]:
        raise RuntimeError("injected")

    for instance in pipeline.classifier._instances:  # whichever runs the batch
        instance.run = broken
    body = {"images": [{"pixels": [[0] * 28] * 28}]}
    assert client.post("/predict", json=body).status_code == 500
    (batch,) = named(list(exporter.get_finished_spans()), "vitserve.batch")
    assert batch.status.status_code == trace.StatusCode.ERROR
    assert [event.name for event in batch.events] == ["exception"]


# --- on, exported over OTLP by a real server, with JSON logs ---------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    requests: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.requests.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    received: list[ExportTraceServiceRequest] = []
    handler = type("Receiver", (_Receiver,), {"requests": received})
    server = ThreadingHTTPServer(("127.0.0.1", free_port(ECO.ports)), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def exported(received: list[ExportTraceServiceRequest]) -> list[tuple[str, str, str]]:
    """(service name, span name, trace id hex) of every span received."""
    spans = []
    for request in received:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                spans.extend(
                    (attributes.get("service.name"), span.name, span.trace_id.hex())
                    for span in scope_spans.spans
                )
    return spans


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_otlp_export_and_json_logs_share_the_trace_id(model_repository, tmp_path, otlp_receiver):
    endpoint, received = otlp_receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "vitserve-under-test",
    }
    log = tmp_path / "service.log"
    with eco_server(model_repository, log, env=env, log_format="json", access_log="true") as (
        server,
        _,
    ):
        response = httpx.post(
            f"{server.url}/predict",
            json={"images": [{"pixels": [[0] * 28] * 28}]},
            headers={
                "X-Request-ID": "trace-me-1",
                "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01",
            },
            timeout=30,
        )
        assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me-1"
        wanted = {"POST /predict", "vitserve.decode", "vitserve.queue"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = {name for _, name, trace_id in exported(received) if trace_id == TRACE_ID}
            if wanted <= names and "vitserve.batch" in {n for _, n, _ in exported(received)}:
                break
            time.sleep(0.1)
    spans = exported(received)
    assert wanted <= {name for _, name, trace_id in spans if trace_id == TRACE_ID}, spans
    assert {service for service, _, _ in spans} == {"vitserve-under-test"}
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "request_id"} <= set(r) for r in records)
    (access,) = [
        r for r in records if r["logger"] == "uvicorn.access" and r.get("path") == "/predict"
    ]
    assert access["request_id"] == "trace-me-1" and access["trace_id"] == TRACE_ID
    assert (access["method"], access["status"]) == ("POST", 200)
    ours = [r for r in records if r["logger"] == "vitserve"]
    assert any(f"serving {MODEL_NAME} version 1" in r["message"] for r in ours)
    assert all(r["request_id"] is None for r in ours if "serving" in r["message"])
