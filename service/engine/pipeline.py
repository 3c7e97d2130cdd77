"""The request pipeline of one served model version: admission, decode slot, thread pool, batcher.

Every route that runs a model goes through here (``classify`` for /predict, ``attend`` for /attention,
``infer`` for the Open Inference Protocol's tensors), so the order is the same everywhere: refuse at once
when the queue cannot take the work, decode and preprocess under a bounded number of decode slots, off the
event loop, queue the rows, and give up the queued rows of a client that went away. A pipeline counts the
requests it holds, so that a version being replaced is released only once they are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from service.contract.model_config import ServingConfig
from service.contract.preprocessing import (
    Invert,
    Prepared,
    Preprocessor,
    decode_image,
    pixels_to_decode,
    shrink,
)
from service.engine.batcher import DynamicBatcher
from service.engine.runtime import Runtime
from service.engine.statistics import ModelStatistics
from service.errors import InvalidInput, NotFound, ServiceUnavailable
from service.frontend.error_responses import request_id_of
from service.frontend.inputs import RawImage
from service.observability import tracing
from service.observability.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger("vitserve")


class DecodeGate:
    """At most ``slots`` requests decode at once; at most ``max_waiters`` wait for a slot, each for at
    most ``timeout_s``; beyond either, 503 with Retry-After at once."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._slots = asyncio.Semaphore(settings.max_concurrent_decodes)
        self._max_waiters = settings.max_decode_waiters
        self._timeout_s = settings.decode_wait_timeout_s
        self._retry_after_s = settings.retry_after_s
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


# Requests whose images have at most this many pixels in all are decoded on the event loop: a thread
# hop costs more than decoding a few thumbnails (BENCHMARKS.md), and such work cannot hold the loop long.
INLINE_PIXELS = 64 * 64 * 4


def declared_pixels(image: RawImage) -> int | None:
    """The pixel count an image declares before any decoding: a pixel list's shape, or the header of
    a PNG, GIF or BMP; None when it cannot be told cheaply (JPEG, WebP, malformed)."""
    if image.data is None:
        rows = image.pixels if isinstance(image.pixels, list) else []
        first = rows[0] if rows and isinstance(rows[0], list) else []
        if first and isinstance(first[0], list):  # C x H x W
            return len(rows) * len(first) * len(first[0])
        return len(rows) * len(first) if first else None
    return pixels_to_decode(image.data)


def decode_inline(images: list[RawImage]) -> bool:
    total = 0
    for image in images:
        pixels = declared_pixels(image)
        if pixels is None:
            return False
        total += pixels
    return total <= INLINE_PIXELS


async def client_gone(request: Request) -> None:
    """Returns when the client has disconnected (the body has been read before this is awaited)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def prepare_batch(
    preprocessor: Preprocessor, images: list[RawImage], invert: Invert, pixel_budget: int
) -> list[Prepared]:
    """Decode and preprocess every image of a request, within its pixel budget (blocking)."""
    prepared, pixels = [], 0
    for image in images:
        if image.data is None:
            prepared.append(preprocessor.from_pixels(image.pixels, image.field, invert))
            continue
        decoded = decode_image(
            image.data,
            image.field,
            preprocessor.max_pixels,
            max(preprocessor.height, preprocessor.width),
        )
        pixels += decoded.size[0] * decoded.size[1]
        if pixels > pixel_budget:
            raise InvalidInput(
                f"{image.field}: the request's images have more than max_pixels_per_request="
                f"{pixel_budget} pixels together; send fewer or smaller images per request",
                field=image.field,
                code="too_many_pixels",
            )
        prepared.append(
            preprocessor.from_image(
                shrink(decoded, preprocessor.height, preprocessor.width), invert
            )
        )
    return prepared


class ModelPipeline:
    """One model version being served: its runtime, preprocessing and batchers."""

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        serving: ServingConfig,
        settings: Settings,
        metrics: Metrics,
        gate: DecodeGate,
    ) -> None:
        self.name = name
        self.version = runtime.files.version
        self.runtime = runtime
        self.metadata = runtime.metadata
        self.serving = serving
        self.settings = settings
        self.gate = gate
        self.preprocessor = Preprocessor(runtime.metadata, settings.max_pixels_per_image)
        self.statistics = ModelStatistics()  # Triton's statistics of this version, every graph
        common: dict[str, Any] = {
            "statistics": self.statistics,
            "max_queue_delay_s": serving.max_queue_delay_s,
            "max_queue_size": serving.max_queue_size,
            "timeout_s": serving.request_timeout_s,
            "retry_after_s": settings.retry_after_s,
            "metrics": metrics,
            "model": name,
        }
        self.classifier = DynamicBatcher(
            "classifier",
            [runtime.classify_with(i) for i in range(len(runtime.classifiers))],
            max_batch_size=serving.max_batch_size,
            preferred_batch_sizes=serving.preferred_batch_sizes,
            **common,
        )
        self.attention = (
            None
            if runtime.attention is None
            else DynamicBatcher(
                "attention",
                runtime.attend,
                max_batch_size=settings.attention_max_batch_size,
                **common,
            )
        )
        self.in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def batchers(self) -> list[DynamicBatcher]:
        return [b for b in (self.classifier, self.attention) if b is not None]

    @property
    def healthy(self) -> bool:
        return all(batcher.healthy for batcher in self.batchers)

    def start(self) -> None:
        for batcher in self.batchers:
            batcher.start()

    @contextlib.contextmanager
    def lease(self) -> Iterator[ModelPipeline]:
        """Held by every request from routing to its answer: a retired version waits for these."""
        self.in_flight += 1
        self._drained.clear()
        try:
            yield self
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._drained.set()

    async def _run(
        self,
        batcher: DynamicBatcher,
        admit: int,
        prepare: Callable[[], np.ndarray],
        request: Request,
        inline: bool = False,
    ) -> list[tuple[np.ndarray, ...]]:
        """Admit, prepare the rows (on the event loop when ``inline``, else in a thread under a
        decode slot), queue them, and answer when they have run."""
        entered, answered = time.perf_counter_ns(), False
        try:
            batcher.admit(admit)
            with tracing.span("vitserve.decode"):
                if inline:
                    rows = prepare()
                else:
                    async with self.gate.slot():
                        rows = await run_in_threadpool(prepare)
            result = await batcher.submit(
                rows, request_id_of(request), partial(client_gone, request)
            )
            answered = True
            return result
        finally:
            self.statistics.record_outcome(answered, time.perf_counter_ns() - entered)

    async def classify(
        self, images: list[RawImage], invert: Invert, request: Request
    ) -> list[np.ndarray]:
        """Logits of each image, in order."""
        budget = self.settings.max_pixels_per_request

        def prepare() -> np.ndarray:
            batch = prepare_batch(self.preprocessor, images, invert, budget)
            return np.stack([item.tensor for item in batch])

        inline = decode_inline(images)
        rows = await self._run(self.classifier, len(images), prepare, request, inline)
        return [logits for (logits,) in rows]

    async def attend(
        self, image: RawImage, invert: Invert, request: Request
    ) -> tuple[Prepared, np.ndarray, np.ndarray]:
        """The prepared image, its logits and its attention ``[layers, heads, tokens, tokens]``."""
        batcher = self.require_attention()
        prepared: list[Prepared] = []

        def prepare() -> np.ndarray:
            prepared.extend(
                prepare_batch(
                    self.preprocessor, [image], invert, self.settings.max_pixels_per_request
                )
            )
            return prepared[0].tensor[np.newaxis]

        ((logits, maps),) = await self._run(batcher, 1, prepare, request)
        return prepared[0], logits, maps

    def require_attention(self) -> DynamicBatcher:
        if self.attention is None:
            raise NotFound(
                f"model {self.name!r} version {self.version} has no attention graph (attention.onnx "
                "with the ViT metadata fields), so /attention is not available for it; use /predict",
                field="model",
                code="no_attention_graph",
            )
        return self.attention

    async def infer(self, decode: Callable[[], np.ndarray], request: Request) -> np.ndarray:
        """Logits ``[N, classes]`` of a tensor batch that ``decode`` builds (blocking, run off the
        event loop under a decode slot) from the request."""
        rows = await self._run(self.classifier, 1, decode, request)
        return np.stack([logits for (logits,) in rows])

    def flush(self) -> None:
        """Run what is queued without waiting for the queue delay (shutdown has begun)."""
        for batcher in self.batchers:
            batcher.flush()

    async def retire(self, timeout_s: float) -> int:
        """Wait for the requests this version holds, then stop its batchers and drop its sessions.
        Returns how many images had to be failed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        except TimeoutError:
            logger.warning(
                "%s version %s: %d requests still running after %.1f s; stopping it anyway",
                self.name,
                self.version,
                self.in_flight,
                timeout_s,
            )
        failed = 0
        for batcher in self.batchers:
            failed += await batcher.stop(timeout_s)
        return failed
