"""One served model version in the engine: its runtime and its batchers.

Every request that runs a model comes here as rows (already decoded and preprocessed by a front end) with
the graph to run them on and a request id, and becomes a :class:`Call`: queued at once, then answered
(at once too, when an idle model ran a lone image inline) or waited for, with a signal that completes
when its client has gone. A pipeline counts the calls it holds, so that a version being replaced is
released only once they are answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from service.contract.model_config import ServingConfig
from service.engine.batch_request import BatchRequest, ClientGone
from service.engine.batcher import DynamicBatcher
from service.engine.runtime import Runtime
from service.engine.statistics import ModelStatistics
from service.errors import InvalidInput, NotFound
from service.link.protocol import Graph, Outputs, Serving, VersionView
from service.observability.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger("vitserve")


class ModelPipeline:
    """One model version being served: its runtime and batchers."""

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        serving: ServingConfig,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self.name = name
        self.version = runtime.files.version
        self.runtime = runtime
        self.metadata = runtime.metadata
        self.serving = serving
        self.settings = settings
        # Triton's statistics of this version, every graph, and its nv_inference_* metrics
        self.statistics = ModelStatistics(metrics.triton_series(name, self.version))
        common: dict[str, Any] = {
            "statistics": self.statistics,
            "max_queue_delay_s": serving.max_queue_delay_s,
            "max_queue_size": serving.max_queue_size,
            "timeout_s": serving.request_timeout_s,
            "retry_after_s": settings.limits.retry_after_s,
            "metrics": metrics,
            "model": name,
            "idle_dispatch": settings.batching.idle_dispatch,
        }
        self.classifier = DynamicBatcher(
            "classifier",
            [runtime.classify_with(i) for i in range(len(runtime.classifiers))],
            max_batch_size=runtime.batch_limit,
            preferred_batch_sizes=serving.preferred_batch_sizes,
            **common,
        )
        self.attention = (
            None
            if runtime.attention is None
            else DynamicBatcher(
                "attention",
                runtime.attend,
                max_batch_size=settings.batching.attention_max_batch_size,
                **common,
            )
        )
        self.view = VersionView(
            name=name,
            version=self.version,
            metadata=self.metadata,
            serving=Serving.of(serving),
            provider=runtime.provider,
            attention=self.attention is not None,
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

    @property
    def accepting(self) -> bool:
        """Takes new requests (a retired version does until it has drained)."""
        return all(batcher.accepting for batcher in self.batchers)

    def start(self) -> None:
        for batcher in self.batchers:
            batcher.start()

    def hold(self) -> None:
        """Held by every call from its arrival to its answer (:class:`Call`): a retired version
        waits for these. Each hold is given back once, by :meth:`release`."""
        self.in_flight += 1
        self._drained.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._drained.set()

    def batcher(self, graph: Graph) -> DynamicBatcher:
        if graph == "classifier":
            return self.classifier
        if self.attention is None:
            raise NotFound(
                f"model {self.name!r} version {self.version} has no attention graph (attention.onnx "
                "with the ViT metadata fields), so /attention is not available for it; use /predict",
                field="model",
                code="no_attention_graph",
            )
        return self.attention

    def call(
        self, graph: Graph, rows: np.ndarray, request_id: str | None = None, alone: bool = False
    ) -> Call:
        """Queue ``rows`` on ``graph``'s batcher (``alone``: its ``enqueue``'s), or raise why not:
        rows that are not float32 images of this version's input shape never join a batch."""
        entered = time.perf_counter_ns()
        try:
            self.check_rows(rows)
            batcher = self.batcher(graph)
            request = batcher.enqueue(rows, request_id, alone)
        except BaseException:
            self.statistics.record_outcome(False, time.perf_counter_ns() - entered)
            raise
        self.hold()
        return Call(self, batcher, request, entered)

    def check_rows(self, rows: np.ndarray) -> None:
        """One bad call must not fail the batch it would join: 422 for rows that are not at least
        one float32 image of this version's ``(channels, height, width)``."""
        if rows.dtype != np.float32 or rows.shape[1:] != self.view.row_shape or not len(rows):
            raise InvalidInput(
                f"rows of {rows.dtype} {list(rows.shape)} for {self.name!r} version "
                f"{self.version}, which takes float32 [N, {', '.join(map(str, self.view.row_shape))}]",
                field="rows",
                code="invalid_rows",
            )

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
        self.statistics.publish()  # its last numbers: nothing publishes a retired version's
        return failed


class Call:
    """One request in a pipeline, from its rows being queued to its answer: it holds the pipeline's
    lease until then, and its outcome and time go into the pipeline's statistics as it ends. Ended
    by :meth:`finish` (its answer handed to a callback: the engine process's way, inline run or
    batched alike) or by :meth:`wait` (awaited: a front end's own engine)."""

    def __init__(
        self, pipeline: ModelPipeline, batcher: DynamicBatcher, request: BatchRequest, entered: int
    ) -> None:
        self._pipeline = pipeline
        self._batcher = batcher
        self._request = request
        self._entered = entered

    @property
    def answered(self) -> bool:
        return self._request.future.done()

    def observe(self, seen: Callable[[Outputs | None, int], None]) -> None:
        """``seen(outputs, model_ns)`` once the call is answered (outputs None when it failed;
        ``model_ns``: its batches' time in the model). A shadow reads the live answer this way,
        from a callback of its own: it cannot change what the caller gets."""
        request = self._request

        def done(future: asyncio.Future) -> None:
            failed = future.cancelled() or future.exception() is not None
            model_ns = sum(times.compute_infer_ns for times in request.batches)
            seen(None if failed else future.result(), model_ns)

        request.future.add_done_callback(done)

    def finish(self, answer: Callable[[Outputs | None, Exception | None], None]) -> None:
        """``answer(outputs, None)`` once every row has run, or ``answer(None, error)``: now when
        the call is answered already (``DynamicBatcher.finish``)."""

        def ended(outputs: Outputs | None, error: Exception | None) -> None:
            self._end(error is None)
            answer(outputs, error)

        self._batcher.finish(self._request, ended)

    def cancel(self) -> None:
        """Its client has gone: the rows still queued never run, and it ends as a 499."""
        self._request.fail(ClientGone())

    async def wait(self, disconnected: Awaitable[object] | None = None) -> Outputs:
        """The outputs once every row has run (see ``DynamicBatcher.answer``), or the error."""
        answered = False
        try:
            outputs = await self._batcher.answer(self._request, disconnected)
            answered = True
            return outputs
        finally:
            self._end(answered)

    def _end(self, answered: bool) -> None:
        pipeline = self._pipeline
        pipeline.statistics.record_outcome(answered, time.perf_counter_ns() - self._entered)
        pipeline.release()
