"""One served model version in the engine: its runtime and its batchers.

A pipeline is made when a version has loaded, and retired when it is replaced or unloaded: what it
holds is the version's runtime, its batchers (one a graph, in ``graphs``), its statistics and its
lease (the requests its batchers hold: a version being replaced is released only once they have
ended). Requests do not pass through it: the engine resolves a route to its version's batcher once
per change of the versions (``ModelManager.target``) and queues on the batcher (``Engine.submit``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from service.contract.model_config import ServingConfig
from service.contract.table import Graph, Serving, VersionView
from service.engine.batcher import DynamicBatcher
from service.engine.request import Lease
from service.engine.runtime import Runtime
from service.engine.statistics import ModelStatistics
from service.errors import NotFound
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
        self.lease = Lease()
        spec = self.metadata.input  # the rows its batchers take (VersionView.row_shape)
        common: dict[str, Any] = {
            "statistics": self.statistics,
            "max_queue_delay_s": serving.max_queue_delay_s,
            "max_queue_size": serving.max_queue_size,
            "timeout_s": serving.request_timeout_s,
            "retry_after_s": limits.retry_after_s,
            "metrics": metrics,
            "model": name,
            "idle_dispatch": batching.idle_dispatch,
            "lease": self.lease,
            "version": self.version,
            "row_shape": (spec.channels, spec.height, spec.width),
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
        self.graphs: dict[Graph, DynamicBatcher] = {"classifier": self.classifier}
        if self.attention is not None:
            self.graphs["attention"] = self.attention

    @property
    def batchers(self) -> list[DynamicBatcher]:
        return list(self.graphs.values())

    @property
    def in_flight(self) -> int:
        """Requests (and shadow batches) holding this version."""
        return self.lease.held

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
        """Hold this version for ``requests`` (its lease): each gives it back by :meth:`release`."""
        self.lease.hold(requests)

    def release(self) -> None:
        self.lease.release()

    def batcher(self, graph: Graph) -> DynamicBatcher:
        """``graph``'s batcher; :meth:`missing`'s 404 for a graph this version lacks."""
        batcher = self.graphs.get(graph)
        if batcher is None:
            raise self.missing(graph)
        return batcher

    def missing(self, graph: Graph) -> NotFound:
        """The 404 for a graph this version lacks (only the attention graph may be missing)."""
        return NotFound(
            f"model {self.name!r} version {self.version} has no attention graph (attention.onnx "
            "with the ViT metadata fields), so /attention is not available for it; use /predict",
            field="model",
            code="no_attention_graph",
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
                await self.lease.drained()
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
