"""What the running service holds: settings, metrics, the loaded model and its batchers, readiness."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal, NamedTuple

from service.batcher import DynamicBatcher
from service.errors import ServiceUnavailable
from service.metrics import Metrics
from service.model_repository import ModelLoadError
from service.preprocessing import Preprocessor
from service.runtime import Runtime
from service.settings import Settings

logger = logging.getLogger("vitserve")

Phase = Literal["starting", "ready", "shutting_down", "stopped"]


class Serving(NamedTuple):
    runtime: Runtime
    preprocessor: Preprocessor
    classifier: DynamicBatcher
    attention: DynamicBatcher


class ServiceState:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.phase: Phase = "starting"
        self.runtime: Runtime | None = None
        self.preprocessor: Preprocessor | None = None
        self.classifier: DynamicBatcher | None = None
        self.attention: DynamicBatcher | None = None
        self.decode_slots = asyncio.Semaphore(settings.max_concurrent_decodes)
        self.metrics.ready.set(0)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    async def start(self) -> None:
        """Load, check and warm the model, then start the batchers; only then ready."""
        settings = self.settings
        if self.phase == "stopped":  # the same app started again (a second TestClient)
            self.phase = "starting"
        try:
            runtime = await asyncio.to_thread(Runtime.load, settings)
        except ModelLoadError as error:
            logger.error("cannot start: %s", error)
            raise
        self.runtime = runtime
        self.preprocessor = Preprocessor(runtime.metadata, settings.max_pixels_per_image)
        common = {
            "max_queue_delay_s": settings.max_queue_delay_s,
            "max_queue_size": settings.max_queue_size,
            "timeout_s": settings.request_timeout_s,
            "retry_after_s": settings.retry_after_s,
            "metrics": self.metrics,
        }
        self.classifier = DynamicBatcher(
            "classifier",
            lambda images: (runtime.classify(images),),
            max_batch_size=settings.max_batch_size,
            **common,
        )
        self.attention = DynamicBatcher(
            "attention", runtime.attend, max_batch_size=settings.attention_max_batch_size, **common
        )
        self.classifier.start()
        self.attention.start()
        entry = runtime.entry
        self.metrics.model_info.labels(entry.name, str(entry.version), runtime.provider).set(1)
        if self.phase == "starting":  # a signal may have arrived while loading
            self.phase = "ready"
            self.metrics.ready.set(1)
        logger.info(
            "serving %s version %s from %s on %s (loaded in %.2f s, warmed up at batch sizes %s in %.2f s)",
            entry.name,
            entry.version,
            entry.directory,
            runtime.provider,
            runtime.load_seconds,
            runtime.classifier_batch_sizes,
            runtime.warmup_seconds,
        )

    def begin_shutdown(self) -> None:
        """Readiness turns false at once; safe to call from a signal handler (sets a field only)."""
        if self.phase in ("starting", "ready"):
            self.phase = "shutting_down"

    async def stop(self) -> None:
        """Not ready any more; finish everything queued and running, then release the workers."""
        self.begin_shutdown()
        self.metrics.ready.set(0)
        for batcher in (self.classifier, self.attention):
            if batcher is not None:
                await batcher.stop(self.settings.graceful_shutdown_s)
        self.phase = "stopped"
        logger.info("stopped: every queued request was answered")

    def serving(self) -> Serving:
        """What a request needs; 503 while the model is still loading."""
        if (
            self.runtime is None
            or self.preprocessor is None
            or self.classifier is None
            or self.attention is None
        ):
            raise ServiceUnavailable(
                "the model is not loaded yet; retry shortly",
                code="not_ready",
                retry_after_s=self.settings.retry_after_s,
            )
        return Serving(self.runtime, self.preprocessor, self.classifier, self.attention)
