"""The engine in a front end's own process and event loop (tests, the smallest deployments), behind
the same interface as the engine process's link (``service/link/client.py``'s ``EngineClient``).

The engine's, not the link's: it imports the engine (and so onnxruntime), which a front end of
``python -m service`` never loads; ``service/launcher/local_app.py`` builds it.
"""

from __future__ import annotations

from typing import Any

from service.contract.control import ControlOp, arguments
from service.contract.table import Call, Graph, ModelTable, Outputs, VersionView
from service.engine.core import Engine, Route
from service.link.client import EngineClient
from service.observability.metrics import Metrics
from service.settings import Settings


class LocalEngine(EngineClient):
    """The engine in the front end's own process and event loop: the lifespan starts and stops it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def create(cls, settings: Settings, metrics: Metrics) -> LocalEngine:
        """A new engine in this process."""
        return cls(Engine(settings, metrics))

    @property
    def table(self) -> ModelTable:
        return self.engine.table()

    @property
    def connected(self) -> bool:
        return True

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def begin_shutdown(self) -> None:
        self.engine.begin_shutdown()

    def admit(self, view: VersionView, requested: int | None, graph: Graph, count: int) -> None:
        self.engine.admit(view.name, view.version, requested, view.preprocessing_key, graph, count)

    async def infer(self, call: Call) -> Outputs:
        view = call.view
        route = Route(view.name, view.version, call.requested, view.preprocessing_key, call.graph)
        return await self.engine.infer(
            route, call.rows, call.request_id, call.disconnected, call.shadow
        )

    async def control(
        self, op: ControlOp, name: str | None = None, version: int | None = None
    ) -> Any:
        return await self.engine.control(op, **arguments(op, name, version))

    def record_failure(self, view: VersionView, ns: int) -> None:
        self.engine.record_failure(view.name, view.version, ns)
