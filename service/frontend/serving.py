"""A request as a front end serves it, decoded here and run in the engine.

Every route that runs a model goes through ``ServedVersion`` (``classify`` for /predict, ``attend`` for
/attention, ``infer`` for the Open Inference Protocol's tensors): the model version the request was
routed to, the request's id, and how to tell that its client has gone. So the order is the same
everywhere: refuse at once when the engine cannot queue the images, decode and preprocess with this
version's metadata under a decode slot (on the event loop for thumbnails, where a thread hop costs more
than the decode, else in a thread), then hand the rows to the engine with the request's id and a signal
that completes when the client has gone, so that its rows still queued never run. Only the rows travel
to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from service.contract.decoding import pixels_to_decode
from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Invert, Prepared, Preprocessor
from service.contract.table import (
    Call,
    Graph,
    Outputs,
    Serving,
    ShadowCopy,
    ShadowMark,
    VersionView,
)
from service.errors import InvalidInput, NotFound, ServiceError, ServiceUnavailable
from service.frontend.error_responses import request_id_of
from service.frontend.inputs import RawImage
from service.frontend.server import CLIENT_GONE
from service.link.client import EngineClient
from service.observability import tracing
from service.observability.metrics import Metrics
from service.settings import LimitSettings, Settings


class FrontEnd(Protocol):
    """What a served request uses of its front end (service/frontend/state.py's ``FrontendState``,
    which holds this module's ``DecodeGate``: named here by its parts, not imported back)."""

    settings: Settings
    engine: EngineClient
    gate: DecodeGate


# Requests whose images have at most this many pixels in all are decoded on the event loop: a thread
# hop costs more than decoding a few thumbnails (BENCHMARKS.md), and such work cannot hold the loop long.
INLINE_PIXELS = 64 * 64 * 4
# Tensor requests of at most this many bytes are decoded, and answered, on the event loop too: waking a
# decode thread took ten times the time of parsing one 28 x 28 FP32 JSON tensor (profile at c=64).
INLINE_TENSOR_BYTES = 64 * 1024


def declared_pixels(image: RawImage) -> int | None:
    """The pixel count an image declares before any decoding: a pixel list's shape, or the header of
    a PNG, GIF or BMP; None when it cannot be told cheaply (JPEG, WebP, malformed)."""
    if image.data is None:
        rows = image.pixels if isinstance(image.pixels, list) else []
        first = rows[0] if rows and isinstance(rows[0], list) else []
        if first and isinstance(first[0], list):  # C x H x W
            return len(rows) * len(first) * len(first[0])
        return len(rows) * len(first) if first else None
    return pixels_to_decode(image.data)  # what decoding makes, not what a header claims


def decode_inline(images: list[RawImage]) -> bool:
    total = 0
    for image in images:
        pixels = declared_pixels(image)
        if pixels is None:
            return False
        total += pixels
    return total <= INLINE_PIXELS


def prepare_batch(
    preprocessor: Preprocessor, images: list[RawImage], invert: Invert, pixel_budget: int
) -> list[Prepared]:
    """Decode and preprocess every image of a request, within its pixel budget (blocking)."""
    prepared, pixels = [], 0
    for image in images:
        if image.data is None:
            prepared.append(preprocessor.from_pixels(image.pixels, image.field, invert))
            continue
        decoded = preprocessor.decode(image.data, image.field)
        pixels += decoded.size[0] * decoded.size[1]
        if pixels > pixel_budget:
            raise InvalidInput(
                f"{image.field}: the request's images have more than max_pixels_per_request="
                f"{pixel_budget} pixels together; send fewer or smaller images per request",
                field=image.field,
                code="too_many_pixels",
            )
        prepared.append(preprocessor.from_image(decoded, invert))
    return prepared


# How a request tells that its client has gone: called once the request has been read, it returns a
# signal that completes then (a task or a future: a request refused before it waits leaves nothing
# un-awaited).
ClientGone = Callable[[], Awaitable[object]]


def client_gone(request: Request) -> ClientGone:
    """An HTTP request's: a future from its connection when the server makes them (python -m
    service's protocol: service/frontend/server.py), else a task that waits for its next ASGI
    message to be a disconnect (the body has been read by then)."""
    from_server = request.scope.get("extensions", {}).get(CLIENT_GONE)
    if from_server is not None:
        return from_server  # type: ignore[no-any-return]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return lambda: asyncio.ensure_future(disconnected())


class DecodeGate:
    """At most ``slots`` requests decode at once; at most ``max_waiters`` wait for a slot, each for at
    most ``timeout_s``; beyond either, 503 with Retry-After at once."""

    def __init__(self, limits: LimitSettings, metrics: Metrics) -> None:
        self._slots = asyncio.Semaphore(limits.max_concurrent_decodes)
        self._max_waiters = limits.max_decode_waiters
        self._timeout_s = limits.decode_wait_timeout_s
        self._retry_after_s = limits.retry_after_s
        self._metrics = metrics
        self.waiting = 0

    def _refuse(self, reason: str, message: str) -> ServiceUnavailable:
        self._metrics.decode_rejections.labels(reason).inc()
        return ServiceUnavailable(message, code="decode_busy", retry_after_s=self._retry_after_s)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots.locked() and self.waiting >= self._max_waiters:
            raise self._refuse(
                "waiters_full",
                f"every decode slot is busy and {self.waiting} requests are waiting for one (the "
                f"limit is max_decode_waiters={self._max_waiters}); retry after "
                f"{self._retry_after_s} s",
            )
        self.waiting += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise self._refuse(
                "timeout",
                f"no decode slot came free within decode_wait_timeout_s={self._timeout_s} s; retry "
                f"after {self._retry_after_s} s",
            ) from None
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._slots.release()


_PREPROCESSORS: dict[tuple[str, int, bool], Preprocessor] = {}


def _preprocessor(view: VersionView, limits: LimitSettings) -> Preprocessor:
    """One Preprocessor per way of preprocessing (the engine's tables are new objects each time)."""
    key = (view.preprocessing_key, limits.max_pixels_per_image, limits.jpeg_draft)
    preprocessor = _PREPROCESSORS.get(key)
    if preprocessor is None:
        if len(_PREPROCESSORS) >= 64:
            _PREPROCESSORS.clear()
        preprocessor = Preprocessor(view.metadata, limits.max_pixels_per_image, limits.jpeg_draft)
        _PREPROCESSORS[key] = preprocessor
    return preprocessor


class ServedVersion:
    """One request as the front end serves it: the model version it was routed to (its name,
    version, metadata), its id, how to tell that its client has gone, and the calls that run it."""

    def __init__(
        self,
        state: FrontEnd,
        view: VersionView,
        requested: int | None,
        request_id: str | None = None,
        client_gone: ClientGone | None = None,
    ) -> None:
        self.state = state
        self.view = view
        self.requested = requested
        self.request_id = request_id
        self.client_gone = client_gone

    @classmethod
    def of(
        cls, request: Request, state: FrontEnd, view: VersionView, requested: int | None
    ) -> ServedVersion:
        """An HTTP request's, with the id the middleware gave it."""
        return cls(state, view, requested, request_id_of(request), client_gone(request))

    # the version's own facts, read from its view (a canary drawn for a tensor call may be swapped)
    @property
    def name(self) -> str:
        return self.view.name

    @property
    def version(self) -> int:
        return self.view.version

    @property
    def metadata(self) -> ModelMetadata:
        return self.view.metadata

    @property
    def serving(self) -> Serving:
        return self.view.serving

    @property
    def settings(self) -> Settings:
        return self.state.settings

    @property
    def preprocessor(self) -> Preprocessor:
        return _preprocessor(self.view, self.settings.limits)

    def _shadow(self, images: bool) -> tuple[ShadowMark | None, Preprocessor | None]:
        """Whether this classifier call is shadowed on its model's candidate (the model's plan, in
        the table: a model without a candidate costs one look), and the candidate's preprocessor
        when the call must carry the candidate's own rows."""
        model = self.state.engine.table.models.get(self.name)
        mark = None if model is None else model.shadow(self.version, images)
        if mark != "own":
            return mark, None
        candidate = model.ready[model.candidate]  # type: ignore[union-attr,index]
        return mark, _preprocessor(candidate, self.settings.limits)

    async def _run(
        self,
        graph: Graph,
        prepare: Callable[[], tuple[np.ndarray, np.ndarray | None]],
        images: int,
        inline: bool = False,
        shadow: ShadowMark | None = None,
    ) -> Outputs:
        """Refuse at once when the engine cannot queue ``images`` more, else prepare the rows (and
        the candidate's own, for a shadow marked "own": on the event loop when ``inline``, else in a
        thread under a decode slot) and run them."""
        self.state.engine.admit(self.view, self.requested, graph, images)
        entered = time.perf_counter_ns()
        try:
            with tracing.span("vitserve.decode"):
                if inline:
                    rows, own = prepare()
                else:
                    async with self.state.gate.slot():
                        rows, own = await run_in_threadpool(prepare)
        except ServiceError:
            self.state.engine.record_failure(self.view, time.perf_counter_ns() - entered)
            raise
        disconnected = None if self.client_gone is None else self.client_gone()
        if shadow == "own" and own is None:  # its rows could not be prepared for the candidate
            shadow = "incompatible"
        copy = None if shadow is None else ShadowCopy(shadow, own)
        call = Call(self.view, self.requested, graph, rows, self.request_id, disconnected, copy)
        return await self.state.engine.infer(call)

    async def classify(self, images: list[RawImage], invert: Invert) -> np.ndarray:
        """Logits ``[images, classes]``, in order."""
        budget = self.settings.limits.max_pixels_per_request
        preprocessor = self.preprocessor
        shadow, candidate = self._shadow(images=True)

        def prepare() -> tuple[np.ndarray, np.ndarray | None]:
            batch = prepare_batch(preprocessor, images, invert, budget)
            rows = np.stack([item.tensor for item in batch])
            if candidate is None:
                return rows, None
            # the same images as the candidate takes them: decoded again, as its own geometry
            # (and draft size) needs; only for the shadowed share of a candidate on other rows
            try:
                own = prepare_batch(candidate, images, invert, budget)
            except ServiceError:  # the candidate cannot take them: never the caller's failure
                return rows, None
            return rows, np.stack([item.tensor for item in own])

        inline = decode_inline(images)
        (logits,) = await self._run("classifier", prepare, len(images), inline, shadow)
        return logits

    async def attend(
        self, image: RawImage, invert: Invert
    ) -> tuple[Prepared, np.ndarray, np.ndarray]:
        """The prepared image, its logits and its attention ``[layers, heads, tokens, tokens]``."""
        self.require_attention()
        prepared: list[Prepared] = []
        preprocessor = self.preprocessor

        def prepare() -> np.ndarray:
            prepared.extend(
                prepare_batch(
                    preprocessor, [image], invert, self.settings.limits.max_pixels_per_request
                )
            )
            return prepared[0].tensor[np.newaxis]

        logits, maps = await self._run("attention", lambda: (prepare(), None), 1)
        return prepared[0], logits[0], maps[0]

    def require_attention(self) -> None:
        if not self.view.attention:
            raise NotFound(
                f"model {self.name!r} version {self.version} has no attention graph (attention.onnx "
                "with the ViT metadata fields), so /attention is not available for it; use /predict",
                field="model",
                code="no_attention_graph",
            )

    async def infer(self, decode: Callable[[], np.ndarray], request_bytes: int) -> np.ndarray:
        """Logits ``[N, classes]`` of a tensor batch that ``decode`` builds (blocking) from a request
        of ``request_bytes``: on the event loop up to ``INLINE_TENSOR_BYTES``, else in a thread under
        a decode slot."""
        inline = request_bytes <= INLINE_TENSOR_BYTES
        model = self.state.engine.table.models.get(self.name)
        if (
            model is not None
            and self.requested is None
            and self.version == model.candidate
            and model.shadow_rows != "same"
        ):  # the canary drew a candidate that cannot take the live version's tensors
            self.view = model.view() or self.view
        shadow, _ = self._shadow(images=False)
        (logits,) = await self._run("classifier", lambda: (decode(), None), 1, inline, shadow)
        return logits
