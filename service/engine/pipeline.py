"""One served model version in the engine: its runtime and its batchers.

Every request that runs a model comes here as rows (already decoded and preprocessed by a front end) with
the graph to run them on, a request id and a signal that completes when its client has gone. A pipeline
counts the requests it holds, so that a version being replaced is released only once they are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterator
from typing import Any

import numpy as np

from service.contract.model_config import ServingConfig
from service.engine.batcher import DynamicBatcher
from service.engine.runtime import Runtime
from service.engine.statistics import ModelStatistics
from service.engine.table import Graph, VersionView
from service.errors import NotFound
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
            "retry_after_s": settings.retry_after_s,
            "metrics": metrics,
            "model": name,
            "idle_dispatch": settings.idle_dispatch,
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
        self.view = VersionView(
            name=name,
            version=self.version,
            metadata=self.metadata,
            serving=serving,
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

    @contextlib.contextmanager
    def lease(self) -> Iterator[ModelPipeline]:
        """Held by every request from its arrival to its answer: a retired version waits for these."""
        self.in_flight += 1
        self._drained.clear()
        try:
            yield self
        finally:
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

    async def run(
        self,
        graph: Graph,
        rows: np.ndarray,
        request_id: str | None,
        disconnected: Awaitable[object] | None,
        alone: bool = False,
    ) -> list[tuple[np.ndarray, ...]]:
        """Each row's outputs, in order, once its batch has run (``alone``: the batcher's)."""
        entered, answered = time.perf_counter_ns(), False
        try:
            result = await self.batcher(graph).submit(rows, request_id, disconnected, alone)
            answered = True
            return result
        finally:
            self.statistics.record_outcome(answered, time.perf_counter_ns() - entered)

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
