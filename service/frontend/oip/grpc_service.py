"""The Open Inference Protocol over gRPC: Triton's ``inference.GRPCInferenceService``, as ``tritonclient.grpc``
speaks it, on ``VITSERVE_GRPC_PORT`` (default 8001, Triton's; 0 turns it off).

The wire format is tritonclient's own generated code (``service_pb2``, ``service_pb2_grpc``); the server is
``grpc.aio`` on the app's event loop, started once the models are loaded and stopped with the app, letting
the calls in flight finish (``graceful_shutdown_s``). Every call does what its HTTP route does, through
the same functions: live, ready, server and model metadata, model ready, ``ModelConfig`` and
``ModelStatistics`` (service/frontend/oip/extensions.py), ``ModelInfer`` through the model's pipeline like
``/v2/models/{name}/infer`` (same batcher, decode slots, queue and limits; service/frontend/oip/grpc_codec.py) and
the repository index, load and unload (service/frontend/oip/repository.py). Streaming, shared memory, trace and log
settings answer UNIMPLEMENTED.

The API key, when the service has one, is the ``authorization: Bearer <key>`` metadata, needed for
everything but live, ready and server metadata. Errors are gRPC statuses with the HTTP route's message:
400 -> INVALID_ARGUMENT, 401 -> UNAUTHENTICATED, 404 -> NOT_FOUND, 503 -> UNAVAILABLE (with a
``retry-after`` trailer), 500 -> INTERNAL; a message over ``max_body_bytes`` is RESOURCE_EXHAUSTED. Every
answer carries the ``x-request-id`` trailer (the client's, when it sends a valid one), and is counted
in ``grpc_server_handled_total`` and ``grpc_server_handling_seconds`` (the gRPC ecosystem's names,
beside HTTP's ``vitserve_http_*``: docs/ecosystem.md). Image files are taken from the message as a
value before the call is admitted (``grpc_codec.image_files``): admitted once, decoded in one hop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.errors import NotFound, ServiceError
from service.frontend.oip import repository
from service.frontend.oip.codec import Decoded, OipError
from service.frontend.oip.grpc_codec import (
    decode_infer_request,
    encode_infer_response,
    image_files,
    parameter,
)
from service.frontend.oip.grpc_limits import grpc_server_options
from service.frontend.oip.routes import (
    metadata_of,
    model_is_ready,
    served_version,
    version_number,
)
from service.frontend.oip.schemas import EXTENSIONS, SERVER_NAME
from service.frontend.security import check_api_key
from service.frontend.state import FrontendState
from service.observability import logs, tracing
from service.observability.refusals import log_error_answer

logger = logging.getLogger("vitserve")

SERVICE = "inference.GRPCInferenceService"
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}
Context = grpc.aio.ServicerContext


def status_code(error: ServiceError) -> grpc.StatusCode:
    """The gRPC status of a service error (an unlisted 4xx is INVALID_ARGUMENT, a 5xx INTERNAL)."""
    default = (
        grpc.StatusCode.INTERNAL if error.status_code >= 500 else grpc.StatusCode.INVALID_ARGUMENT
    )
    return _STATUS.get(error.status_code, default)


def code_name(code: grpc.StatusCode) -> str:
    """A status code as the ``grpc_code`` label spells it (Go's names, as go-grpc-prometheus writes
    them: ``OK``, ``InvalidArgument``, ``Canceled``)."""
    if code is grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "OK" if code is grpc.StatusCode.OK else code.name.title().replace("_", "")


def _count(state: FrontendState, method: str, code: grpc.StatusCode, started: float) -> None:
    """A call answered: its ``grpc_server_*`` series (service/observability/metrics.py), as the
    middleware counts an HTTP request (service/frontend/middleware.py)."""
    metrics = state.metrics
    metrics.grpc_handled.labels("unary", SERVICE, method, code_name(code)).inc()
    elapsed = time.perf_counter() - started
    metrics.grpc_handling.labels("unary", SERVICE, method).observe(elapsed)


def _rpc(protected: bool) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Any]]:
    """A call: its request id, its span, the API key when ``protected``, errors as statuses, and its
    metrics."""

    def wrap(method: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        @functools.wraps(method)
        async def handler(self: InferenceServicer, request: Any, context: Context) -> Any:
            started = time.perf_counter()
            metadata = tuple(context.invocation_metadata() or ())
            headers = {key.lower(): value for key, value in metadata if isinstance(value, str)}
            request_id = logs.request_id(headers.get("x-request-id"))
            token = logs.REQUEST_ID.set(request_id)
            trailers = [("x-request-id", request_id)]
            context.set_trailing_metadata(trailers)
            code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: the client went away
            try:
                with tracing.server_span(SERVICE, method.__name__, metadata):
                    if protected:
                        check_api_key(
                            headers.get("authorization"), self.state.settings.server.api_key
                        )
                    answer = await method(self, request, context, request_id)
                code = grpc.StatusCode.OK
                return answer
            except ServiceError as error:
                log_error_answer(error.status_code, error.code, request_id, error.message)
                if "Retry-After" in error.headers:
                    trailers.append(("retry-after", error.headers["Retry-After"]))
                    context.set_trailing_metadata(trailers)
                code = status_code(error)
                await context.abort(code, error.message)
            except Exception as error:
                if isinstance(error, grpc.aio.AbortError):
                    code = grpc.StatusCode.UNKNOWN
                    raise
                logger.exception("unhandled error [request %s]", request_id, exc_info=error)
                code = grpc.StatusCode.INTERNAL
                await context.abort(
                    code, f"internal error; quote request id {request_id} when reporting it"
                )
            finally:
                logs.REQUEST_ID.reset(token)
                _count(self.state, method.__name__, code, started)

        return handler

    return wrap


def _required_name(name: str, field: str = "name") -> str:
    if not name:
        raise OipError(f"{field} is empty: name the model")
    return name


def _over(context: Context) -> asyncio.Future[None]:
    """A signal that completes once the call is over (cancelled by the client, or past its
    deadline), so that its queued rows never run."""
    loop = asyncio.get_running_loop()
    over: asyncio.Future[None] = loop.create_future()

    def done(_: object) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(lambda: over.done() or over.set_result(None))

    context.add_done_callback(done)
    return over


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: FrontendState, version: str) -> None:
        self.state = state
        self.version = version

    @_rpc(protected=False)
    async def ServerLive(self, request: Any, context: Context, request_id: str) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc(protected=False)
    async def ServerReady(self, request: Any, context: Context, request_id: str) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.state.ready)

    @_rpc(protected=False)
    async def ServerMetadata(self, request: Any, context: Context, request_id: str) -> Any:
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=self.version, extensions=EXTENSIONS
        )

    @_rpc(protected=True)
    async def ModelReady(self, request: Any, context: Context, request_id: str) -> Any:
        try:
            ready = model_is_ready(
                self.state, _required_name(request.name), request.version or None
            )
        except NotFound:
            ready = False  # as Triton answers for a model or version it does not know
        return service_pb2.ModelReadyResponse(ready=ready)

    @_rpc(protected=True)
    async def ModelMetadata(self, request: Any, context: Context, request_id: str) -> Any:
        metadata = metadata_of(self.state, _required_name(request.name), request.version or None)
        return json_format.ParseDict(metadata.model_dump(), service_pb2.ModelMetadataResponse())

    @_rpc(protected=True)
    async def ModelConfig(self, request: Any, context: Context, request_id: str) -> Any:
        config = await self.state.engine.control(
            "config",
            name=_required_name(request.name),
            version=version_number(request.version or None),
        )
        response = service_pb2.ModelConfigResponse()
        json_format.ParseDict(config, response.config)
        return response

    @_rpc(protected=True)
    async def ModelStatistics(self, request: Any, context: Context, request_id: str) -> Any:
        stats = await self.state.engine.control(
            "statistics", name=request.name or None, version=version_number(request.version or None)
        )
        response = service_pb2.ModelStatisticsResponse()
        for entry in stats:
            json_format.ParseDict(entry, response.model_stats.add())
        return response

    @_rpc(protected=True)
    async def ModelInfer(self, request: Any, context: Context, request_id: str) -> Any:
        name = _required_name(request.model_name, "model_name")
        over = _over(context)
        served = await served_version(
            self.state, name, request.model_version or None, request_id, lambda: over
        )
        limit = served.settings.limits.max_images_per_request
        files = image_files(request, served.metadata, limit)
        if files is not None:  # image files: admitted once, decoded as /predict decodes them
            logits = await served.classify(files.images, "auto")
            outputs = files.outputs
        else:
            decoded: list[Decoded] = []

            def decode() -> Any:
                decoded.append(decode_infer_request(request, served.metadata, limit))
                return decoded[0].batch

            logits = await served.infer(decode, request.ByteSize())
            outputs = decoded[0].outputs
        return encode_infer_response(
            request, outputs, logits, served.metadata, name, str(served.version)
        )

    @_rpc(protected=True)
    async def RepositoryIndex(self, request: Any, context: Context, request_id: str) -> Any:
        response = service_pb2.RepositoryIndexResponse()
        for model in await repository.index_of(self.state, request.ready):
            response.models.add(**model.model_dump())
        return response

    @_rpc(protected=True)
    async def RepositoryModelLoad(self, request: Any, context: Context, request_id: str) -> Any:
        parameters = {key: parameter(value) for key, value in request.parameters.items()}
        repository.refuse_load_parameters(parameters)
        await repository.load_model(self.state, _required_name(request.model_name, "model_name"))
        return service_pb2.RepositoryModelLoadResponse()

    @_rpc(protected=True)
    async def RepositoryModelUnload(self, request: Any, context: Context, request_id: str) -> Any:
        name = _required_name(request.model_name, "model_name")
        await repository.unload_model(self.state, name)
        return service_pb2.RepositoryModelUnloadResponse()


def _unimplemented(name: str) -> Callable[..., Any]:
    async def handler(self: InferenceServicer, request: Any, context: Context) -> None:
        _count(self.state, name, grpc.StatusCode.UNIMPLEMENTED, time.perf_counter())
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{name} is not implemented by vitserve; it serves unary ModelInfer and the health, "
            f"metadata, config, statistics and repository calls (extensions: "
            f"{', '.join(EXTENSIONS)})",
        )

    handler.__name__ = name
    return handler


for _name in (
    "ModelStreamInfer",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
    "TraceSetting",
    "LogSettings",
):
    setattr(InferenceServicer, _name, _unimplemented(_name))


class GrpcServer:
    """The gRPC listener of one app: started after the models load, stopped before they are released.

    A front end of ``python -m service`` that cannot bind the port serves HTTP all the same and binds
    gRPC as soon as it can (every ``BIND_RETRY_S``, logged): one protocol's port does not take the
    other down, nor crash-loop the front ends. A single process that cannot bind it does not start."""

    BIND_RETRY_S = 1.0

    def __init__(self, state: FrontendState, version: str) -> None:
        self.state = state
        self.version = version
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._binding: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self._bind()
        except OSError as error:
            if self.state.worker is None:
                raise
            logger.error(
                "%s; front end %d serves HTTP, and gRPC once the port can be bound (tried every "
                "%g s)",
                error,
                self.state.worker,
                self.BIND_RETRY_S,
            )
            self._binding = asyncio.get_running_loop().create_task(self._bind_when_free())

    async def _bind_when_free(self) -> None:
        while True:
            await asyncio.sleep(self.BIND_RETRY_S)
            try:
                await self._bind()
                return
            except OSError:
                continue

    async def _bind(self) -> None:
        settings = self.state.settings
        # one front end: a port in use is an error; several share it with the supervisor, which
        # holds it (service/launcher/ports.py)
        server = grpc.aio.server(
            options=grpc_server_options(
                settings.server, settings.limits, self.state.worker is not None
            )
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(self.state, self.version), server
        )
        host = f"[{settings.server.host}]" if ":" in settings.server.host else settings.server.host
        address = f"{host}:{settings.server.grpc_port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(
                f"cannot listen for gRPC on {address} ({error}): is the port in use? Set "
                "VITSERVE_GRPC_PORT to a free port, or 0 to turn gRPC off"
            ) from None
        await server.start()
        self.server = server
        logger.info("gRPC (Open Inference Protocol) listening on %s", address)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; give the calls in flight ``grace_s`` to finish."""
        if self._binding is not None:
            self._binding.cancel()
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
