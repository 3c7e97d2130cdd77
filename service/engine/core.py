"""The engine: every model version, its batchers and sessions, and the engine's phase. No transport.

Front ends reach it in their own process (``local.py``), or over the process link (``server.py``): they read
its :class:`~service.contract.table.ModelTable`, hand it requests (:class:`~service.engine.request.Request`:
rows, a request id and a reply) with the :class:`Route` they resolved, to :meth:`Engine.submit`, or
await one with :meth:`Engine.infer`, and call :meth:`Engine.control` for the repository index, explicit
load and unload, the served configuration and Triton's statistics.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from msgspec.structs import replace

from service.contract.control import OPERATIONS
from service.contract.model_repository import ModelLoadError
from service.contract.table import Graph, ModelTable, Outputs, Phase, ShadowCopy
from service.engine import promotion, reports
from service.engine.batcher import DynamicBatcher
from service.engine.model_manager import ModelManager, Route
from service.engine.pipeline import ModelPipeline
from service.engine.request import Request, awaited
from service.engine.shadow import Shadows
from service.errors import ServiceError
from service.observability.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger("vitserve")


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.phase: Phase = "starting"
        self.manager = ModelManager(settings, metrics)
        self.shadows = Shadows(self.manager, metrics.shadow)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._promoter: asyncio.Task | None = None  # poll mode's automatic promotion
        self._failed_at_deadline = 0
        self._generation = 0
        self._last_signature: tuple = ()
        self._table: ModelTable | None = None
        self.metrics.ready.set(0)

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.manager.ready

    # --- life -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load, check and warm every model, then start the batchers; only then ready."""
        if self.phase == "stopped":  # the same app started again (a second TestClient)
            self.phase = "starting"
            self.manager = ModelManager(self.settings, self.metrics)
            self.shadows = Shadows(self.manager, self.metrics.shadow)
        self._loop = asyncio.get_running_loop()
        try:
            await self.manager.start()
        except ModelLoadError as error:
            logger.error("cannot start: %s", error)
            await self.manager.stop(self.settings.server.graceful_shutdown_s)
            raise
        if self.phase == "starting":  # a signal may have arrived while loading
            self.phase = "ready"
            self.metrics.ready.set(1)
        if self.settings.repository.model_control == "poll":
            every_s = self.settings.repository.repository_poll_s
            self._promoter = self._loop.create_task(
                promotion.watch(self.manager, self.shadows, every_s)
            )

    def begin_shutdown(self) -> None:
        """Readiness turns false at once; queued images run without waiting for a batch to fill, and
        whatever is still unanswered when graceful_shutdown_s has passed is answered 503. Safe to call
        from a signal handler: it only sets a field and schedules the rest on the event loop."""
        if self.phase in ("starting", "ready"):
            self.phase = "shutting_down"
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.metrics.ready.set(0)
        self.manager.flush()
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_deadline())

    async def _drain_deadline(self) -> None:
        """At the deadline, answer what is left 503 while the front ends can still send it."""
        await asyncio.sleep(self.settings.server.graceful_shutdown_s)
        self._failed_at_deadline += self.manager.fail_unanswered()

    async def stop(self) -> None:
        """Not ready any more; finish everything queued and running, then release the models."""
        self.begin_shutdown()
        self.metrics.ready.set(0)
        timeout = self.settings.server.graceful_shutdown_s
        if self._drain is not None:
            self._drain.cancel()
        if self._promoter is not None:
            self._promoter.cancel()
        failed = self._failed_at_deadline + await self.manager.stop(timeout)
        self.shadows.close()
        self.phase = "stopped"
        if failed:
            logger.error(
                "stopped: the drain timed out after %.1f s; %d images were failed with 503",
                timeout,
                failed,
            )
        else:
            logger.info("stopped: every queued request was answered")

    # --- what front ends see ----------------------------------------------------------------------

    def table(self) -> ModelTable:
        """The models as front ends see them; its generation grows whenever anything in it changes.
        Built again only then (front ends are sent it every few milliseconds)."""
        ready = self.manager.ready
        signature = (self.phase, ready, self.manager.routing_signature())
        if signature != self._last_signature or self._table is None:
            self._last_signature = signature
            self._generation += 1
            self._table = replace(
                self.manager.routing(), generation=self._generation, phase=self.phase, healthy=ready
            )
        return self._table

    # --- work -------------------------------------------------------------------------------------

    def admit(
        self,
        name: str,
        version: int,
        requested: int | None,
        key: int,
        graph: Graph,
        count: int,
    ) -> None:
        """Raise the 503 that :meth:`submit` would answer now for ``count`` images."""
        route = Route(name, version, requested, key, graph)
        pipeline, batcher = self.manager.routes.get(route) or self.manager.target(route)
        if batcher is None:
            raise pipeline.missing(graph)
        batcher.admit(count)

    def submit(self, route: Route, requests: list[Request], alone: bool = False) -> None:
        """Queue ``requests`` (each rows of one image each, preprocessed for ``route``'s version) on
        ``route``'s graph, together: the version is resolved once for all of them. Each ends through
        its reply, answered or refused. ``alone``: no other request can join these in this turn of
        the event loop, so an idle model runs them at once, and a lone image of a fast model is
        answered before this returns (``DynamicBatcher.enqueue``, which checks their rows)."""
        target = self.manager.routes.get(route)
        if target is None:  # the route's first calls since its model's versions changed
            target = self._resolve(route, requests)
            if target is None:
                return
        pipeline, batcher = target
        if route.graph == "classifier" and any(r.shadow is not None for r in requests):
            self.shadows.offer(pipeline, requests)
        batcher.enqueue(requests, alone)

    def _resolve(
        self, route: Route, requests: list[Request]
    ) -> tuple[ModelPipeline, DynamicBatcher] | None:
        """``route``'s version and batcher (``ModelManager.target``, which keeps a ready version's
        for the next calls), or None once ``requests`` are refused: a version that cannot take them
        (404, 503), or a graph it lacks (404, counted in its statistics)."""
        try:
            pipeline, batcher = self.manager.target(route)
        except Exception as error:
            for request in requests:
                request.fail(error)
            return None
        if batcher is None:
            for request in requests:
                pipeline.classifier.refuse(request, pipeline.missing(route.graph))
            return None
        return pipeline, batcher

    async def infer(
        self,
        route: Route,
        rows: np.ndarray,
        request_id: str | None = None,
        disconnected: Awaitable[object] | None = None,
        shadow: ShadowCopy | None = None,
    ) -> Outputs:
        """:meth:`submit` one request of ``rows`` and wait for its outputs (a front end's own
        engine); ``disconnected`` completes when its client has gone; ``shadow``: its copy for the
        model's candidate."""
        return await awaited(
            lambda request: self.submit(route, [request]), rows, request_id, disconnected, shadow
        )

    def record_failure(self, name: str, version: int, ns: int) -> None:
        """A request for this version failed in a front end (its input was refused while decoding):
        Triton's statistics count it as a failed inference, as if it had failed here."""
        model = self.manager.models.get(name)
        status = model.versions.get(version) if model is not None else None
        if status is not None and status.pipeline is not None:
            status.pipeline.statistics.record_outcome(False, ns)

    async def control(self, op: str, **arguments: Any) -> Any:
        """The repository index, explicit load and unload, the served config and the statistics;
        ``metrics`` writes the statistics to their Prometheus series, before a scrape. ``arguments``:
        those ``op`` takes (service/contract/control.py's table, which every caller follows)."""
        manager = self.manager
        handlers: dict[str, Callable[..., Any]] = {
            "index": lambda: reports.index(manager),
            "load": lambda name: self._explicit("load", name),
            "unload": lambda name: self._explicit("unload", name),
            "config": lambda name, version=None: reports.served_config(manager, name, version),
            "statistics": lambda name=None, version=None: reports.statistics(
                manager, name, version
            ),
            "metrics": manager.publish_statistics,
            "shadow": self.shadows.report,
            "promote": lambda name, version=None: promotion.decide(
                manager, "promote", name, version
            ),
            "rollback": lambda name: promotion.decide(manager, "rollback", name, None),
        }
        handler = handlers.get(op)
        if handler is None:
            raise ValueError(f"unknown engine control {op!r}; known: {', '.join(OPERATIONS)}")
        value = handler(**arguments)
        return await value if inspect.isawaitable(value) else value

    async def _explicit(self, op: str, name: str) -> None:
        """An explicit load or unload: refused unless the model control mode is 'explicit'."""
        mode = self.settings.repository.model_control
        if mode != "explicit":
            raise ServiceError(
                f"explicit model {op} is not allowed: the model control mode is '{mode}' "
                "(set VITSERVE_MODEL_CONTROL=explicit)",
                status_code=400,
                code="bad_request",
            )
        if op == "unload":
            return await self.manager.unload(name)
        try:
            return await self.manager.load(name)
        except ModelLoadError as error:
            raise ServiceError(
                f"failed to load '{name}': {error}", status_code=400, code="load_failed"
            ) from None
