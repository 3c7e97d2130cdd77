"""What the running service holds: settings, metrics, the models and their pipelines, and its phase."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import Request

from service.contract.model_repository import ModelLoadError
from service.engine.model_manager import ModelManager
from service.observability.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger("vitserve")

Phase = Literal["starting", "ready", "shutting_down", "stopped"]


class ServiceState:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.phase: Phase = "starting"
        self.manager = ModelManager(settings, metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._failed_at_deadline = 0
        self.metrics.ready.set(0)

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.manager.ready

    async def start(self) -> None:
        """Load, check and warm every model, then start the batchers; only then ready."""
        if self.phase == "stopped":  # the same app started again (a second TestClient)
            self.phase = "starting"
            self.manager = ModelManager(self.settings, self.metrics)
        self._loop = asyncio.get_running_loop()
        try:
            await self.manager.start()
        except ModelLoadError as error:
            logger.error("cannot start: %s", error)
            await self.manager.stop(self.settings.graceful_shutdown_s)
            raise
        if self.phase == "starting":  # a signal may have arrived while loading
            self.phase = "ready"
            self.metrics.ready.set(1)

    def begin_shutdown(self) -> None:
        """Readiness turns false at once; queued images run without waiting for a batch to fill, and
        whatever is still unanswered when graceful_shutdown_s has passed is answered 503. Safe to call
        from a signal handler: it only sets a field and schedules the rest on the event loop."""
        if self.phase in ("starting", "ready"):
            self.phase = "shutting_down"
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.manager.flush()
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_deadline())

    async def _drain_deadline(self) -> None:
        """At the deadline, answer what is left 503 while the server can still send it (uvicorn
        waits a little longer than this before it cancels open requests)."""
        await asyncio.sleep(self.settings.graceful_shutdown_s)
        self._failed_at_deadline += self.manager.fail_unanswered()

    async def stop(self) -> None:
        """Not ready any more; finish everything queued and running, then release the models."""
        self.begin_shutdown()
        self.metrics.ready.set(0)
        timeout = self.settings.graceful_shutdown_s
        if self._drain is not None:
            self._drain.cancel()
        failed = self._failed_at_deadline + await self.manager.stop(timeout)
        self.phase = "stopped"
        if failed:
            logger.error(
                "stopped: the drain timed out after %.1f s; %d images were failed with 503",
                timeout,
                failed,
            )
        else:
            logger.info("stopped: every queued request was answered")


def service_state(request: Request) -> ServiceState:
    return request.app.state.service
