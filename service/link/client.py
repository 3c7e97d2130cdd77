"""The engine as a front end sees it: the table of models, inference on rows, and control calls.

Two kinds: ``service/link/remote.py``'s ``RemoteEngine`` reaches the engine process over the link;
``service/engine/local.py``'s ``LocalEngine`` runs the engine in the front end's own process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from service.contract.control import ControlOp
from service.contract.table import Call, Graph, ModelTable, Outputs, VersionView


class EngineClient(ABC):
    @property
    @abstractmethod
    def table(self) -> ModelTable:
        """The engine's latest table of models."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """The engine can be reached now."""

    async def table_to_route_by(self) -> ModelTable:
        """The table a request is routed by: the latest, where nothing can be waited for."""
        return self.table

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def begin_shutdown(self) -> None:
        """The front end is shutting down (safe to call from a signal handler)."""

    @abstractmethod
    def admit(self, view: VersionView, requested: int | None, graph: Graph, count: int) -> None:
        """Raise the 503 the engine would answer for ``count`` more images now (checked before
        decoding, so that an overloaded service refuses at once instead of decoding in vain)."""

    @abstractmethod
    async def infer(self, call: Call) -> Outputs:
        """Every output of ``call``'s graph, stacked over its rows in order (service/engine/core.py's
        ``Engine.submit``)."""

    @abstractmethod
    async def control(
        self, op: ControlOp, name: str | None = None, version: int | None = None
    ) -> Any:
        """``Engine.control``, the one remote call the operations below are made of."""

    async def index(self) -> list[tuple[str, int | None, str, str]]:
        """Triton's repository index: (name, version, state, reason) of every model version."""
        return await self.control("index")

    async def load(self, name: str) -> None:
        await self.control("load", name)

    async def unload(self, name: str) -> None:
        await self.control("unload", name)

    async def config(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The ModelConfig ``name`` is served with, as JSON."""
        return await self.control("config", name, version)

    async def statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` entries."""
        return await self.control("statistics", name, version)

    async def shadow(self, name: str) -> dict[str, Any]:
        """The model's shadow comparison (service/engine/shadow.py)."""
        return await self.control("shadow", name)

    async def promote(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The candidate becomes live (service/engine/promotion.py); ``version``: the one expected."""
        return await self.control("promote", name, version)

    async def rollback(self, name: str) -> dict[str, Any]:
        """The candidate's trial ends; the live version stays."""
        return await self.control("rollback", name)

    async def publish_metrics(self) -> None:
        """The engine's statistics written to their Prometheus series, before a scrape."""
        await self.control("metrics")

    @abstractmethod
    def record_failure(self, view: VersionView, ns: int) -> None:
        """``Engine.record_failure``: a request refused here counts in the version's statistics."""
