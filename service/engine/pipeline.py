"""One served model version in the engine: its runtime and its batchers.

Every request that runs a model comes here as a :class:`~service.engine.request.Request` (rows already
decoded and preprocessed by a front end, a request id, a reply) with the graph to run it on, and is
queued on that graph's batcher, or refused on its own. A pipeline counts the requests it holds (the
batchers' lease), so that a version being replaced is released only once they have ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from service.contract.model_config import ServingConfig
from service.contract.table import Graph, Serving, VersionView
from service.engine.batcher import DynamicBatcher
from service.engine.request import Request
from service.engine.runtime import Runtime
from service.engine.statistics import ModelStatistics
from service.errors import InvalidInput, NotFound, ServiceError
from service.observability.metrics import Metrics
from service.settings import BatchingSettings, LimitSettings

logger = logging.getLogger("vitserve")


class ModelPipeline:
    """One model version being served: its runtime and batchers."""

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        serving: ServingConfig,
        batching: BatchingSettings,
        limits: LimitSettings,
        metrics: Metrics,
    ) -> None:
        self.name = name
        self.version = runtime.files.version
        self.runtime = runtime
        self.metadata = runtime.metadata
        self.serving = serving
        # Triton's statistics of this version, every graph, and its nv_inference_* metrics
        self.statistics = ModelStatistics(metrics.triton_series(name, self.version))
        common: dict[str, Any] = {
            "statistics": self.statistics,
            "max_queue_delay_s": serving.max_queue_delay_s,
            "max_queue_size": serving.max_queue_size,
            "timeout_s": serving.request_timeout_s,
            "retry_after_s": limits.retry_after_s,
            "metrics": metrics,
            "model": name,
            "idle_dispatch": batching.idle_dispatch,
            "lease": self,
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
                max_batch_size=batching.attention_max_batch_size,
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

    def hold(self, requests: int = 1) -> None:
        """Held by every request from its being queued to its end (the batchers' lease): a retired
        version waits for these. Each request's hold is given back once, by :meth:`release`."""
        self.in_flight += requests
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

    def submit(self, graph: Graph, requests: list[Request], alone: bool = False) -> None:
        """Queue ``requests`` together on ``graph``'s batcher (``alone``: see its ``enqueue``). A
        request whose rows are not float32 images of this version's input shape never joins a batch:
        it is answered its 422 on its own, and one for a graph this version lacks its 404."""
        try:
            batcher = self.batcher(graph)
        except ServiceError as error:
            for request in requests:
                self.classifier.refuse(request, error)
            return
        admitted = []
        for request in requests:
            problem = self.rows_problem(request.rows)
            if problem is None:
                admitted.append(request)
            else:
                batcher.refuse(request, problem)
        batcher.enqueue(admitted, alone)

    def rows_problem(self, rows: np.ndarray) -> InvalidInput | None:
        """One bad call must not fail the batch it would join: a 422 for rows that are not at least
        one float32 image of this version's ``(channels, height, width)``."""
        if rows.dtype == np.float32 and rows.shape[1:] == self.view.row_shape and len(rows):
            return None
        return InvalidInput(
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
