"""What a front end holds: settings, metrics, its decode slots, its phase and its link to the engine.

No model state: the models are the engine's. The front end reads the engine's table to route a request,
decodes it, and asks the engine to run the rows (service/frontend/serving.py).
"""

from __future__ import annotations

from typing import Literal

from fastapi import Request

from service.frontend.serving import DecodeGate
from service.link.client import EngineClient
from service.observability.metrics import Metrics
from service.settings import Settings

Phase = Literal["starting", "ready", "shutting_down", "stopped"]


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
