"""Every model of the repository, each version loaded, swapped and released without a failed request.

Triton's model control modes: ``none`` loads at start-up only; ``poll`` follows the repository every
``repository_poll_s`` (a new version is loaded once its files have stayed the same for two scans, so a
directory still being copied is never half-loaded; a changed version is loaded again; a removed one is
released); ``explicit`` loads and unloads a model when asked (``/v2/repository/models/{name}/load``)
and, as Triton's, loads at start-up only the models named (``--load-model``, ``VITSERVE_MODELS``; ``*``
for all): a model not loaded answers 404 naming it, the index lists it UNAVAILABLE ("unloaded"), and
the service is ready once it is up.

A version takes traffic only once it is loaded, checked against its metadata and warmed up; the version it
replaces stops taking new requests at that moment and is released once the requests it admitted are
answered. A version that fails to load is UNAVAILABLE with its reason, and what was served keeps serving.
Which versions are served follows each model's ``version_policy`` (config.pbtxt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import NamedTuple

from service.contract.model_config import ModelConfig, ServingConfig, select_versions
from service.contract.model_repository import (
    CONFIG_FILE,
    ModelLoadError,
    VersionFiles,
    model_names,
    version_numbers,
)
from service.contract.table import Graph, ModelTable, ModelView
from service.engine.batcher import DynamicBatcher
from service.engine.model_versions import (
    ManagedModel,
    Signature,
    VersionStatus,
    file_signature,
    model_config,
    relative,
    report_loaded,
    scan_version,
    serving_settings,
)
from service.engine.pipeline import ModelPipeline
from service.engine.runtime import Runtime
from service.errors import NotFound
from service.observability.metrics import Metrics, forget_series
from service.settings import Settings

logger = logging.getLogger("vitserve")


class Route(NamedTuple):
    """Where a front end resolved a request: model ``name``'s ``version`` (``requested``: the
    version the client asked for, None for the newest; ``key``: the version's preprocessing key),
    and the graph to run."""

    name: str
    version: int
    requested: int | None
    key: int
    graph: Graph


# what runs a route's calls: its version's pipeline and the graph's batcher (None: it has none)
Target = tuple[ModelPipeline, DynamicBatcher | None]


class ModelManager:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ManagedModel] = {}
        # each route resolved to a ready version since the versions last changed (:meth:`target`):
        # the engine looks its calls up here, and resolves only a route not in it
        self.routes: dict[Route, tuple[ModelPipeline, DynamicBatcher]] = {}
        self.default_name: str | None = None
        self._seen: dict[tuple[str, int], Signature] = {}  # poll: a new version's first sighting
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()
        self._retired: set[ModelPipeline] = set()  # released, still answering what they admitted
        self.repository_names: frozenset[str] = frozenset()  # as last scanned
        self._first_load: frozenset[str] = frozenset()  # the models start() is loading

    @property
    def repository(self) -> Path:
        return Path(self.settings.repository.model_repository)

    # --- start and stop ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model (or those named), then follow the repository in poll mode. Fails when
        the default model, or a model named in VITSERVE_MODELS, has no version that loads; in
        explicit mode the default model may be one that is not loaded yet."""
        available = model_names(self.repository)
        self.repository_names = frozenset(available)
        named = self.settings.repository.model_list
        missing = [name for name in named if name not in available]
        if missing:
            raise ModelLoadError(
                f"VITSERVE_MODELS names {', '.join(map(repr, missing))}, not in {self.repository}; "
                f"available: {', '.join(available) or 'none'}"
            )
        names = available if self.settings.repository.loads_every_model else named
        servable = available if self.explicit else names
        default = self.settings.repository.model_name or (names or servable or [None])[0]
        if default is None or default not in servable:
            raise ModelLoadError(
                f"model {default!r} not found in {self.repository}; available: "
                f"{', '.join(names) or 'none'} (set VITSERVE_MODEL_NAME)"
            )
        self.default_name = default
        self._first_load = frozenset(names)
        try:
            async with self._lock:  # all at once, each in a thread, as Triton's model-load threads
                await asyncio.gather(*(self._sync_model(name, initial=True) for name in names))
        finally:
            self._first_load = frozenset()
        required = set(named) | ({default} & set(names))
        for name in sorted(required):
            model = self.models.get(name)
            if model is None or not model.ready_versions():
                reasons = "; ".join(
                    f"version {s.version}: {s.reason}"
                    for s in (model.versions.values() if model else [])
                )
                raise ModelLoadError(
                    f"model {name!r} has no version that loads: {reasons or 'none'}"
                )
        if self.settings.repository.model_control == "poll":
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever(), name="poll")

    def _serving_pipelines(self) -> list[ModelPipeline]:
        return [
            status.pipeline
            for model in self.models.values()
            for status in model.versions.values()
            if status.pipeline is not None
        ]

    def publish_statistics(self) -> None:
        """Every serving version's statistics to its ``nv_inference_*`` series."""
        for pipeline in self._serving_pipelines():
            pipeline.statistics.publish()

    def flush(self) -> None:
        """Shutdown has begun: every batcher runs what is queued without waiting for its delay."""
        for pipeline in self._serving_pipelines():
            pipeline.flush()

    def fail_unanswered(self) -> int:
        """Answer 503 to every image still queued or running (the drain's deadline); how many."""
        return sum(
            batcher.fail_all("the service shut down before this request was answered")
            for pipeline in [*self._serving_pipelines(), *self._retired]
            for batcher in pipeline.batchers
        )

    async def stop(self, timeout_s: float) -> int:
        """Stop following the repository and release every version; how many images were failed."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        pipelines = self._serving_pipelines()
        for model in self.models.values():
            model.versions.clear()
        self._changed()
        results = await asyncio.gather(
            *(pipeline.retire(timeout_s) for pipeline in pipelines), *self._retiring
        )
        return sum(r for r in results if isinstance(r, int))

    # --- lookup -----------------------------------------------------------------------------------

    @property
    def explicit(self) -> bool:
        return self.settings.repository.model_control == "explicit"

    def routing(self) -> ModelTable:
        """The models as requests are resolved against them (service/contract/table.py holds the rules:
        unknown, not ready, not loaded in explicit mode)."""
        return ModelTable(
            default_name=self.default_name,
            models=self.views(),
            retry_after_s=self.settings.limits.retry_after_s,
            explicit=self.explicit,
            repository_names=self.repository_names,
            first_load=self._first_load,
        )

    def model(self, name: str | None) -> ManagedModel:
        return self.models[self.routing().model(name).name]

    def resolve(self, name: str | None = None, version: int | None = None) -> ModelPipeline:
        """The pipeline for a request: 404 for an unknown model or version, 503 while loading."""
        view = self.routing().resolve(name, version)
        pipeline = self.models[view.name].versions[view.version].pipeline
        assert pipeline is not None  # a version in the table's ready set has one
        return pipeline

    def target(self, route: Route) -> Target:
        """The pipeline that runs a call a front end resolved to ``route.version`` (``requested`` is
        the version the client asked for, None for the newest), and the graph's batcher. A version
        swapped out since the front end resolved the call still takes it while it drains; a call for
        the newest version goes to the version now routed to when it takes the same rows (``key``),
        so a swap fails no request. What resolves to a ready version is kept in :attr:`routes` until
        the versions change (:meth:`_changed`), so the calls after it are not resolved again."""
        name, version, requested, key, graph = route
        model = self.models.get(name)
        status = model.versions.get(version) if model is not None else None
        pipeline: ModelPipeline | None = None
        if status is not None and status.state == "READY" and status.pipeline is not None:
            pipeline = status.pipeline
        elif requested is None and model is not None:
            current = model.pipeline()
            if current is not None and current.view.preprocessing_key == key:
                pipeline = current
        if pipeline is not None:
            batcher = pipeline.graphs.get(graph)
            # kept only as an honest front end routes (so a hostile one cannot grow it without
            # bound): the version's own key, and the newest version or this one asked for
            honest = key == pipeline.view.preprocessing_key and requested in (None, version)
            if batcher is not None and honest:
                self.routes[route] = (pipeline, batcher)
            return pipeline, batcher
        for retired in self._retired:
            if retired.name == name and retired.version == version and retired.accepting:
                return retired, retired.graphs.get(graph)
        pipeline = self.resolve(name, requested)
        return pipeline, pipeline.graphs.get(graph)

    def _changed(self) -> None:
        """A version's state, a model's config or the versions served changed: routes resolve anew."""
        self.routes.clear()

    def views(self) -> dict[str, ModelView]:
        """Every model as front ends see it (service/contract/table.py)."""
        return {name: model.view() for name, model in self.models.items()}

    @property
    def ready(self) -> bool:
        """The default model serves; in explicit mode, as Triton's, the service is ready once up
        (every model loaded is healthy), whichever models are loaded."""
        if self.explicit and self.default_name is not None:
            return all(
                status.pipeline.healthy
                for model in self.models.values()
                for status in model.versions.values()
                if status.pipeline is not None
            )
        model = self.models.get(self.default_name) if self.default_name is not None else None
        pipeline = model.pipeline() if model is not None else None  # what resolve() would give
        return pipeline is not None and pipeline.healthy

    def routing_signature(self) -> tuple:
        """What :meth:`routing` is made of: an equal signature, an equal table (and much cheaper to
        build: the engine looks at it ten times a second)."""
        return (
            self.default_name,
            self.repository_names,
            self._first_load,
            tuple(model.signature() for model in self.models.values()),
        )

    def known_names(self) -> set[str]:
        """The repository's models (kept for the front ends' table) and the models managed."""
        try:
            self.repository_names = frozenset(model_names(self.repository))
        except ModelLoadError:
            self.repository_names = frozenset()
        return set(self.repository_names) | set(self.models)

    # --- loading ----------------------------------------------------------------------------------

    def _serving(self, name: str, config: ModelConfig) -> ServingConfig:
        pinned = self.settings.repository.model_version if name == self.default_name else None
        return serving_settings(config, name, self.settings.batching, self.settings.limits, pinned)

    async def _sync_model(self, name: str, initial: bool = False) -> list[str]:
        """Bring one model in line with the repository: load what its policy wants and is new or
        changed, release what it no longer wants; the reasons of the loads that failed. Call with
        the lock held."""
        failures: list[str] = []
        model = self.models.get(name)
        config_signature = file_signature(self.repository / name / CONFIG_FILE)
        if (
            model is not None
            and model.config_problem
            and model.config_signature == config_signature
        ):
            return [model.config_problem]  # the same broken file: said once, when it appeared
        try:  # parsed in a thread: a large file must not stall the event loop
            config = await asyncio.to_thread(model_config, self.repository, name)
            serving = self._serving(name, config)
        except ModelLoadError as error:
            problem = relative(str(error), self.repository)
            self._failed(name, None, problem)
            if model is None:
                model = self.models[name] = ManagedModel(name, serving=None)
            model.config_problem, model.config_signature = problem, config_signature
            for status in model.versions.values():
                if status.pipeline is not None:
                    status.reason = (
                        f"serving the previous config; the new one is refused: {problem}"
                    )
            return [problem]
        if model is None:
            model = self.models[name] = ManagedModel(name, serving, config_signature)
        config_changed = model.config_signature != config_signature or model.config_problem != ""
        model.serving, model.config_signature = serving, config_signature
        model.config, model.config_problem = config, ""
        self._changed()  # its plan (the live version, the candidate) may have changed
        available = version_numbers(self.repository / name)
        wanted = select_versions(serving.version_policy, available)
        scanned = {version: self._scan(name, version, initial) for version in available}
        for version in wanted:
            files, signature, problem, settled = scanned[version]
            status = model.versions.get(version)
            if status is not None and status.signature == signature and not config_changed:
                continue
            if not settled:
                continue
            if files is None:
                self._record_failure(model, version, status, signature, problem)
                failures.append(relative(problem, self.repository))
            elif (
                failure := await self._load_version(model, version, files, signature)
            ) is not None:
                failures.append(failure)
        # what is served now keeps serving until a version the policy wants is ready to replace it
        replaced = not wanted or any(
            model.versions.get(v) is not None and model.versions[v].state == "READY" for v in wanted
        )
        for version, status in list(model.versions.items()):
            if version in wanted:
                continue
            if status.pipeline is not None and replaced:
                self._retire(model, version, "removed from the repository or the version policy")
            elif status.pipeline is None:
                del model.versions[version]
                self._changed()
        for key in [k for k in self._seen if k[0] == name and k[1] not in available]:
            del self._seen[key]
        if serving.version_policy[0] == "specific":
            for version in sorted(set(serving.version_policy[1]) - set(available)):
                model.versions[version] = VersionStatus(
                    version,
                    "UNAVAILABLE",
                    f"version {version} of model {name!r} not found in {name}/; "
                    f"available: {', '.join(map(str, available)) or 'none'}",
                )
                self._changed()
        return failures

    def _scan(
        self, name: str, version: int, initial: bool
    ) -> tuple[VersionFiles | None, Signature, str, bool]:
        """A version's files, their signature, why they cannot be read, and whether they have settled:
        looked the same on the previous scan (a directory still being copied in changes between
        scans; an atomic rename never does)."""
        files, signature, problem = scan_version(self.repository, name, version)
        settled = initial or self._seen.get((name, version)) == signature
        self._seen[(name, version)] = signature
        return files, signature, problem, settled

    async def _load_version(
        self, model: ManagedModel, version: int, files: VersionFiles, signature: Signature
    ) -> str | None:
        """Load one version and route to it; the reason when it fails (what was served stays)."""
        previous = model.versions.get(version)
        if previous is None:
            model.versions[version] = VersionStatus(version, "LOADING", signature=signature)
        batching, limits = self.settings.batching, self.settings.limits
        try:
            runtime = await asyncio.to_thread(
                Runtime.load, files, self.settings.runtime, model.serving, batching
            )
        except (ModelLoadError, MemoryError) as error:  # never left LOADING
            reason = relative(str(error) or "out of memory (MemoryError)", self.repository)
            self._record_failure(model, version, previous, signature, reason)
            return reason
        pipeline = ModelPipeline(model.name, runtime, model.serving, batching, limits, self.metrics)
        pipeline.start()
        old = previous.pipeline if previous is not None else None
        model.versions[version] = VersionStatus(
            version, "READY", pipeline=pipeline, signature=signature, config=model.config
        )
        model.unloaded = False
        self._changed()
        report_loaded(self.metrics, model, version, runtime, files)
        if old is not None:
            self._release(old)
        return None

    def _record_failure(
        self,
        model: ManagedModel,
        version: int,
        previous: VersionStatus | None,
        signature: Signature,
        reason: str,
    ) -> None:
        reason = relative(reason, self.repository)
        self._failed(model.name, version, reason)
        if previous is not None and previous.pipeline is not None:
            # the files or the config changed and do not load: keep serving what was loaded
            if previous.signature == signature:  # the same files: the new config is the cause
                previous.reason = f"serving the previous config; the new one failed: {reason}"
            else:
                previous.reason = f"kept the loaded files; the new ones failed: {reason}"
            previous.signature = signature
            return
        model.versions[version] = VersionStatus(version, "UNAVAILABLE", reason, signature=signature)
        self._changed()

    def _failed(self, name: str, version: int | None, reason: str) -> None:
        self.metrics.model_load_failures.labels(name).inc()
        logger.error("cannot load %s version %s: %s", name, version if version else "-", reason)

    def _retire(self, model: ManagedModel, version: int, why: str) -> None:
        status = model.versions.pop(version)
        self._changed()
        logger.info("releasing %s version %s: %s", model.name, version, why)
        if status.pipeline is not None:
            labels = (model.name, str(version), status.pipeline.runtime.provider)
            labels += (status.pipeline.metadata.precision,)
            forget_series(self.metrics.model_info, *labels)
            self._release(status.pipeline)

    def _release(self, pipeline: ModelPipeline) -> None:
        """Release a version no longer routed to, once the requests it admitted are answered."""
        task = asyncio.get_running_loop().create_task(
            pipeline.retire(self.settings.server.graceful_shutdown_s)
        )
        self._retiring.add(task)
        self._retired.add(pipeline)
        task.add_done_callback(self._retiring.discard)
        task.add_done_callback(lambda _: self._retired.discard(pipeline))

    # --- control ----------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        self.known_names()
        async with self._lock:
            # The models being served too: a removed folder is no longer in the listing.
            names = self.settings.repository.model_list or sorted(
                {*model_names(self.repository), *self.models}
            )
            for name in names:
                if (self.repository / name).is_dir():
                    await self._sync_model(name)
                elif name in self.models:
                    for version in list(self.models[name].versions):
                        self._retire(self.models[name], version, "model directory removed")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository.repository_poll_s)
            try:
                await self.poll_once()
            except Exception:  # a scan error must not end the polling
                logger.exception("scanning the model repository %s failed", self.repository)

    async def load(self, name: str) -> None:
        """Explicit control: (re)load a model's versions as its policy says; 400 with the reason
        when none loads."""
        if name not in self.known_names() or not (self.repository / name).is_dir():
            raise NotFound(f"model {name!r} is not in the model repository", field="model")
        async with self._lock:
            model = self.models.get(name)
            if model is not None:
                model.config_signature = ()  # an explicit load re-reads everything
            failures = await self._sync_model(name, initial=True)
            model = self.models[name]
        if failures or not model.ready_versions():  # 400 with the reasons (explicit mode)
            kept = model.ready_versions()
            still = f"; still serving version(s) {kept}" if kept else ""
            raise ModelLoadError(f"{'; '.join(failures) or 'no version directory'}{still}")

    async def unload(self, name: str) -> None:
        """Explicit control: stop routing to every version of a model and release them once drained."""
        async with self._lock:
            model = self.model(name)
            for version in list(model.versions):
                self._retire(model, version, "unloaded on request")
            model.unloaded = True
