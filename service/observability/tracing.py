"""OpenTelemetry tracing, configured only by the standard ``OTEL_*`` environment variables.

Off unless asked for: with none of them set, neither the SDK's ``TracerProvider`` nor the FastAPI
instrumentation is imported, and every hook below costs one ``None`` check. It is on when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, exporting OTLP over
HTTP/protobuf, or when ``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``; ``OTEL_SDK_DISABLED=true``
turns it off whatever else is set. The SDK reads the rest itself: ``OTEL_SERVICE_NAME`` (default
``vitserve``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, the exporter's
``OTEL_EXPORTER_OTLP_*``, and the instrumentation's ``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS``.

Spans: the HTTP server spans of ``opentelemetry-instrumentation-fastapi``; a server span per gRPC call
(its parent taken from the call's ``traceparent`` metadata); and vitserve's own: ``vitserve.decode``
(decoding a request's images or tensors, a child of the request's span), ``vitserve.queue`` (from
entering the queue to the start of the batch, a child of the request's span) and ``vitserve.batch``
(one model run: a root span, linked to the span of every request with images in the batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

if TYPE_CHECKING:
    from fastapi import FastAPI
    from opentelemetry.sdk.trace import TracerProvider

TRACER_NAME = "vitserve"
_NULL: AbstractContextManager[Any] = contextlib.nullcontext()
# The tracer of the running app; None when tracing is off (set by the app's lifespan).
_tracer: trace.Tracer | None = None


class TracingConfigError(ValueError):
    """OTEL_* variables that ask for something this service cannot do."""


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [name for name in names if name]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not names and endpoint:
        names = ["otlp"]
    return [name for name in names if name != "none"]


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the ``OTEL_*`` variables in ``environ`` turn tracing on."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(_exporter_names(environ))


def provider_from_environment(environ: Mapping[str, str]) -> TracerProvider | None:
    """The SDK's TracerProvider with the exporters ``environ`` asks for; None when tracing is off."""
    if not wanted(environ):
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "vitserve"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in _exporter_names(environ):
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                raise TracingConfigError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: vitserve exports "
                    "OTLP over http/protobuf (port 4318 of a collector)"
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER names {name!r}; vitserve exports to 'otlp' "
                "(http/protobuf), 'console' or 'none'"
            )
    return provider


def instrument(app: FastAPI, provider: TracerProvider) -> None:
    """HTTP server spans for every route of ``app`` (call before the app first starts)."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)


def activate(provider: trace.TracerProvider | None) -> None:
    """vitserve's own spans go to ``provider`` from now on (None: tracing off)."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME)


def current_ids() -> tuple[str | None, str | None]:
    """The current trace id and span id in hex (as log fields); None when there is none."""
    if _tracer is None:
        return None, None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None, None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def span(name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Any]:
    """A child span of the current one, current while the block runs."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes)


def server_span(
    service: str, method: str, metadata: Iterable[tuple[str, Any]]
) -> AbstractContextManager[Any]:
    """The span of one gRPC call, its parent the ``traceparent`` the client sent, if any."""
    if _tracer is None:
        return _NULL
    from opentelemetry import propagate

    carrier = {key: value for key, value in metadata if isinstance(value, str)}
    return _tracer.start_as_current_span(
        f"{service}/{method}",
        context=propagate.extract(carrier),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
    )


@dataclass(eq=False)
class QueueTrace:
    """A request's wait in a batcher's queue, and the request span its batch links to."""

    span: trace.Span
    request: trace.SpanContext

    def end(self) -> None:
        if self.span.is_recording():
            self.span.end()


def enter_queue(images: int) -> QueueTrace | None:
    """Start the queue span of a request's images (None when tracing is off)."""
    if _tracer is None:
        return None
    return QueueTrace(
        _tracer.start_span("vitserve.queue", attributes={"vitserve.images": images}),
        trace.get_current_span().get_span_context(),
    )


def start_batch(
    model: str, graph: str, instance: int, waits: Iterable[QueueTrace | None]
) -> trace.Span | None:
    """End the queue spans of a batch's requests and start its own span, linked to theirs (None when
    tracing is off). Not made current: the batch starts in one task and ends in another."""
    if _tracer is None:
        return None
    distinct = list({id(wait): wait for wait in waits if wait is not None}.values())
    for wait in distinct:
        wait.end()
    links = [trace.Link(wait.request) for wait in distinct if wait.request.is_valid]
    return _tracer.start_span(
        "vitserve.batch",
        context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root: it serves many requests
        links=links,
        attributes={
            "vitserve.model": model,
            "vitserve.graph": graph,
            "vitserve.instance": instance,
            "vitserve.requests": len(distinct),
        },
    )


def end_batch(span: trace.Span | None, error: BaseException | None = None) -> None:
    """End a batch's span, failed with ``error`` when its model run raised one."""
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.end()


def carrier() -> dict[str, str] | None:
    """The current trace context as W3C ``traceparent`` headers, to send across the process hop
    (None when tracing is off or there is no context)."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers or None


def attached(headers: Mapping[str, str] | None) -> AbstractContextManager[Any]:
    """Run the block in the trace context another process sent (see :func:`carrier`)."""
    if not headers or _tracer is None:
        return _NULL
    return _attached(headers)


@contextlib.contextmanager
def _attached(headers: Mapping[str, str]) -> Iterator[None]:
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        context.detach(token)
