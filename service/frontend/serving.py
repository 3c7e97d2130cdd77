"""The model version a request is served by, as a front end holds it: decode here, run in the engine.

Every route that runs a model goes through here (``classify`` for /predict, ``attend`` for /attention,
``infer`` for the Open Inference Protocol's tensors), so the order is the same everywhere: decode and
preprocess with this version's metadata under a decode slot (on the event loop for thumbnails, else in a
thread), then hand the rows to the engine with the request's id and a signal that completes when the client
has gone, so that its rows still queued never run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from service.contract.preprocessing import Invert, Prepared, Preprocessor
from service.errors import NotFound, ServiceError
from service.frontend.decode import (
    INLINE_TENSOR_BYTES,
    client_gone,
    decode_inline,
    prepare_batch,
)
from service.frontend.error_responses import request_id_of
from service.frontend.inputs import RawImage
from service.frontend.state import FrontendState
from service.link.protocol import Graph, Outputs, VersionView
from service.observability import tracing
from service.settings import Settings

_PREPROCESSORS: dict[tuple[tuple[str, str], int], Preprocessor] = {}


def _preprocessor(view: VersionView, max_pixels: int) -> Preprocessor:
    """One Preprocessor per way of preprocessing (the engine's tables are new objects each time)."""
    key = (view.preprocessing_key, max_pixels)
    preprocessor = _PREPROCESSORS.get(key)
    if preprocessor is None:
        if len(_PREPROCESSORS) >= 64:
            _PREPROCESSORS.clear()
        preprocessor = _PREPROCESSORS[key] = Preprocessor(view.metadata, max_pixels)
    return preprocessor


@dataclass(frozen=True)
class Call:
    """Who is asking: the request id, and a signal that completes when the client has gone."""

    request_id: str | None
    disconnected: Awaitable[object] | None = None

    @classmethod
    def of(cls, request: Request) -> Call:
        # a task, not a bare coroutine: a request refused before it waits leaves nothing un-awaited
        return cls(request_id_of(request), asyncio.ensure_future(client_gone(request)))


class ServedVersion:
    """One request's model version: its name, version, metadata and the calls that run it."""

    def __init__(self, state: FrontendState, view: VersionView, requested: int | None) -> None:
        self.state = state
        self.view = view
        self.requested = requested
        self.name = view.name
        self.version = view.version
        self.metadata = view.metadata
        self.serving = view.serving

    @property
    def settings(self) -> Settings:
        return self.state.settings

    @property
    def preprocessor(self) -> Preprocessor:
        return _preprocessor(self.view, self.settings.limits.max_pixels_per_image)

    async def _run(
        self,
        graph: Graph,
        prepare: Callable[[], np.ndarray],
        call: Call,
        images: int,
        inline: bool = False,
    ) -> Outputs:
        """Refuse at once when the engine cannot queue ``images`` more, else prepare the rows (on
        the event loop when ``inline``, else in a thread under a decode slot) and run them."""
        self.state.engine.admit(self.view, self.requested, graph, images)
        entered = time.perf_counter_ns()
        try:
            with tracing.span("vitserve.decode"):
                if inline:
                    rows = prepare()
                else:
                    async with self.state.gate.slot():
                        rows = await run_in_threadpool(prepare)
        except ServiceError:
            self.state.engine.record_failure(self.view, time.perf_counter_ns() - entered)
            raise
        return await self.state.engine.infer(
            self.view, self.requested, graph, rows, call.request_id, call.disconnected
        )

    async def classify(self, images: list[RawImage], invert: Invert, call: Call) -> np.ndarray:
        """Logits ``[images, classes]``, in order."""
        budget = self.settings.limits.max_pixels_per_request
        preprocessor = self.preprocessor

        def prepare() -> np.ndarray:
            batch = prepare_batch(preprocessor, images, invert, budget)
            return np.stack([item.tensor for item in batch])

        (logits,) = await self._run("classifier", prepare, call, len(images), decode_inline(images))
        return logits

    async def attend(
        self, image: RawImage, invert: Invert, call: Call
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

        logits, maps = await self._run("attention", prepare, call, 1)
        return prepared[0], logits[0], maps[0]

    def require_attention(self) -> None:
        if not self.view.attention:
            raise NotFound(
                f"model {self.name!r} version {self.version} has no attention graph (attention.onnx "
                "with the ViT metadata fields), so /attention is not available for it; use /predict",
                field="model",
                code="no_attention_graph",
            )

    async def infer(
        self, decode: Callable[[], np.ndarray], call: Call, request_bytes: int
    ) -> np.ndarray:
        """Logits ``[N, classes]`` of a tensor batch that ``decode`` builds (blocking) from a request
        of ``request_bytes``: on the event loop up to ``INLINE_TENSOR_BYTES``, else in a thread under
        a decode slot."""
        inline = request_bytes <= INLINE_TENSOR_BYTES
        (logits,) = await self._run("classifier", decode, call, 1, inline)
        return logits
