"""Decoding on the front end: a request's images become the rows the engine runs.

Decoding and preprocessing happen in the front end's process, under a bounded number of decode slots, off
the event loop (or on it for thumbnails, where a thread hop costs more than the decode), with the metadata
of the model version the request was resolved to. Only the rows travel to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request

from service.contract.preprocessing import Invert, Prepared, Preprocessor, pixels_to_decode
from service.errors import InvalidInput, ServiceUnavailable
from service.frontend.inputs import RawImage
from service.observability.metrics import Metrics
from service.settings import LimitSettings


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
