"""What the model manager knows of one model: its versions and their states, and its serving settings
(config.pbtxt with the environment's overrides)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from service.contract.candidate_plan import CandidatePlan, candidate_plan
from service.contract.candidates import RowsPlan, live_version, shadow_rows
from service.contract.model_config import (
    DEFAULT_INSTANCE_COUNT,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_SIZE,
    DEFAULT_QUEUE_DELAY_US,
    DEFAULT_REQUEST_TIMEOUT_US,
    ModelConfig,
    ModelConfigError,
    ServingConfig,
    read_model_config,
    serving_config,
)
from service.contract.model_repository import (
    CONFIG_FILE,
    ModelLoadError,
    VersionFiles,
    version_files,
)
from service.contract.table import ModelView
from service.engine.pipeline import ModelPipeline
from service.errors import ServiceUnavailable
from service.settings import BatchingSettings, LimitSettings

if TYPE_CHECKING:
    from service.engine.runtime import Runtime
    from service.observability.metrics import Metrics

logger = logging.getLogger("vitserve")
State = Literal["LOADING", "READY", "UNAVAILABLE", "UNLOADING"]
Signature = tuple


@dataclass
class VersionStatus:
    version: int
    state: State
    reason: str = ""
    pipeline: ModelPipeline | None = None
    signature: Signature = ()
    config: ModelConfig | None = None  # the config.pbtxt it was loaded with (READY ones)


@dataclass
class ManagedModel:
    name: str
    serving: ServingConfig | None
    config_signature: Signature = ()
    versions: dict[int, VersionStatus] = field(default_factory=dict)
    unloaded: bool = False
    config: ModelConfig | None = None  # the config.pbtxt being served, parsed once per change
    config_problem: str = ""  # why the file on disk is not the one served, if it is not

    _plan: tuple[ModelConfig | None, CandidatePlan] = (None, CandidatePlan())
    # (live pipeline, candidate pipeline) -> how they are compared, worked out once per pair
    _comparison: tuple[tuple, tuple[RowsPlan, str]] = ((), ("same", ""))

    @property
    def plan(self) -> CandidatePlan:
        """Its candidate on live traffic, from the config served (checked as it was loaded; read
        once per config, not per request)."""
        if self._plan[0] is not self.config:
            plan = candidate_plan(self.config) if self.config is not None else CandidatePlan()
            self._plan = (self.config, plan)
        return self._plan[1]

    def live_version(self) -> int | None:
        plan = self.plan
        return live_version(self.ready_versions(), plan.live_version, plan.candidate_version)

    def ready_versions(self) -> list[int]:
        return sorted(v for v, s in self.versions.items() if s.state == "READY" and s.pipeline)

    def signature(self) -> tuple:
        """What :meth:`view` is made of: an equal signature, an equal view."""
        return (
            self.name,
            self.unloaded,
            self.config_problem,
            tuple((v, s.state, s.reason, id(s.pipeline)) for v, s in self.versions.items()),
            self.plan,  # the live version, the candidate and the canary's share
        )

    def comparison(self) -> tuple[RowsPlan, str] | None:
        """How its candidate is compared with its live version (both ready), and why; None when no
        candidate is tried. Logged once per pair: a pair that cannot be compared is said at load."""
        live, candidate = self.pipeline(), self.pipeline(self.plan.candidate_version)
        if live is None or candidate is None or candidate is live:
            return None
        pair = (live, candidate)
        if self._comparison[0] != pair:
            rows, why = shadow_rows(live.view.metadata, candidate.view.metadata)
            self._comparison = (pair, (rows, why))
            log = logger.warning if rows == "none" else logger.info
            log(
                "%s: candidate version %s against live version %s: %s",
                self.name,
                candidate.version,
                live.version,
                why,
            )
        return self._comparison[1]

    def view(self) -> ModelView:
        """This model as front ends see it (service/contract/table.py)."""
        comparison = self.comparison()
        return ModelView(
            name=self.name,
            versions={v: (s.state, s.reason) for v, s in self.versions.items()},
            ready={v: self.versions[v].pipeline.view for v in self.ready_versions()},  # type: ignore[union-attr]
            unloaded=self.unloaded,
            problem=self.config_problem,
            live=self.live_version(),
            candidate=self.plan.candidate_version,
            canary_percent=self.plan.canary_percent,
            shadow_percent=self.plan.shadow_percent,
            shadow_rows="same" if comparison is None else comparison[0],
        )

    def pipeline(self, version: int | None = None) -> ModelPipeline | None:
        ready = self.ready_versions()
        if version is None:
            live = self.live_version()
            return None if live is None else self.versions[live].pipeline
        return self.versions[version].pipeline if version in ready else None


def default_config(name: str) -> ModelConfig:
    """Serving settings of a model whose directory has no config.pbtxt."""
    config = ModelConfig(name=name, max_batch_size=DEFAULT_MAX_BATCH_SIZE)
    config.dynamic_batching.max_queue_delay_microseconds = DEFAULT_QUEUE_DELAY_US
    config.instance_group.add(count=DEFAULT_INSTANCE_COUNT)
    return config


def file_signature(path: Path) -> Signature:
    try:
        stat = path.stat()
    except OSError:
        return ()
    return (stat.st_size, stat.st_mtime_ns)


def served_model_config(model: ManagedModel, version: int | None = None) -> ModelConfig:
    """A copy of the config.pbtxt that ``version`` (None: the newest ready one) is served with: the
    one it was loaded with, whatever the file says now. Without a ready version, the file as last
    read; 503 naming the problem when that file is refused (or no valid one was ever read). Parsed
    when the file changed, never per request."""
    ready = model.ready_versions()
    number = version if version is not None else model.live_version()
    config = model.versions[number].config if number in ready else None
    if config is None:
        if model.config is None or model.config_problem:
            raise ServiceUnavailable(
                f"model '{model.name}' has no valid config: {model.config_problem or 'not loaded'}",
                code="invalid_config",
            )
        config = model.config
    copy = ModelConfig()
    copy.CopyFrom(config)
    return copy


def relative(text: str, repository: Path) -> str:
    """``text`` with the repository's path taken out: answers name files relative to it."""
    for root in {str(repository.resolve()), str(repository)}:
        text = text.replace(root.rstrip("/") + "/", "")
    return text


def model_config(repository: Path, name: str) -> ModelConfig:
    """The model's config.pbtxt (:func:`default_config` without one); :class:`ModelLoadError` naming
    it relative to the repository. Blocking: call it from a thread."""
    path = repository / name / CONFIG_FILE
    try:
        return (
            read_model_config(path, f"{name}/{CONFIG_FILE}")
            if path.is_file()
            else default_config(name)
        )
    except ModelConfigError as error:
        raise ModelLoadError(str(error)) from error


def serving_settings(
    config: ModelConfig,
    name: str,
    batching: BatchingSettings,
    limits: LimitSettings,
    pinned_version: int | None = None,
) -> ServingConfig:
    """The model's config with the environment's batching overrides. A queue without a size or timeout
    there gets the service's bounds: an unbounded queue is not a setting this service offers."""
    overrides: dict[str, object] = dict(batching.overrides())
    if pinned_version is not None:
        overrides["version_policy"] = ("specific", (pinned_version,))
    try:
        serving = serving_config(config, overrides)
        candidate_plan(config)  # refused at load, never found wrong per request
    except ModelConfigError as error:
        raise ModelLoadError(f"{name}/{CONFIG_FILE}: {error}") from error
    serving = replace(
        serving,
        max_queue_size=serving.max_queue_size or DEFAULT_MAX_QUEUE_SIZE,
        request_timeout_s=serving.request_timeout_s or DEFAULT_REQUEST_TIMEOUT_US / 1e6,
    )
    if serving.max_queue_size < limits.max_images_per_request:
        raise ModelLoadError(
            f"{name}: max_queue_size ({serving.max_queue_size}) must be at least "
            f"max_images_per_request ({limits.max_images_per_request}), or a full-sized "
            "request could never be queued"
        )
    return serving


def scan_version(
    repository: Path, name: str, version: int
) -> tuple[VersionFiles | None, Signature, str]:
    """The files of a version and their signature, or why they cannot be read."""
    try:
        files = version_files(repository, name, version)
        return files, files.signature(), ""
    except (ModelLoadError, OSError) as error:
        return None, ("unreadable", str(error)), str(error)


def report_loaded(
    metrics: Metrics, model: ManagedModel, version: int, runtime: Runtime, files: VersionFiles
) -> None:
    """A version now serving: its load and warm-up times and its info series, and the log line."""
    labels = (model.name, str(version))
    metrics.model_load_seconds.labels(*labels, "load").set(runtime.load_seconds)
    metrics.model_load_seconds.labels(*labels, "warmup").set(runtime.warmup_seconds)
    metrics.model_info.labels(*labels, runtime.provider, runtime.metadata.precision).set(1)
    assert model.serving is not None
    logger.info(
        "serving %s version %s from %s on %s (loaded in %.2f s, warmed up in %.2f s; "
        "%s, %d instance(s))",
        model.name,
        version,
        files.directory,
        runtime.provider,
        runtime.load_seconds,
        runtime.warmup_seconds,
        runtime.batching,
        model.serving.instance_count,
    )
