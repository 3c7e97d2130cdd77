"""What a front end holds: settings, metrics, its decode slots, its phase and its link to the engine.

No model state: the models are the engine's. The front end reads the engine's table to route a request,
decodes it, and asks the engine to run the rows (service/frontend/serving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request

from service.errors import ServiceUnavailable
from service.link.client import EngineClient
from service.observability.metrics import Metrics
from service.settings import LimitSettings, Settings

Phase = Literal["starting", "ready", "shutting_down", "stopped"]


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


class FrontendState:
    def __init__(
        self, settings: Settings, metrics: Metrics, engine: EngineClient, worker: int | None = None
    ) -> None:
        self.settings = settings
        self.worker = worker  # this front end's slot among several, None when alone
        self.metrics = metrics
        self.engine = engine
        self.gate = DecodeGate(settings.limits, metrics)
        self.phase: Phase = "starting"

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.engine.connected and self.engine.table.ready

    async def start(self) -> None:
        if self.phase == "stopped":  # the same app started again (a second TestClient)
            self.phase = "starting"
        await self.engine.start()
        if self.phase == "starting":  # a signal may have arrived meanwhile
            self.phase = "ready"

    def begin_shutdown(self) -> None:
        """Not ready from now on (safe to call from a signal handler)."""
        if self.phase in ("starting", "ready"):
            self.phase = "shutting_down"
            self.engine.begin_shutdown()

    async def stop(self) -> None:
        self.begin_shutdown()
        await self.engine.stop()
        self.phase = "stopped"


def frontend_state(request: Request) -> FrontendState:
    return request.app.state.frontend
