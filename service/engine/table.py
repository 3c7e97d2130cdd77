"""What a front end knows of the models: a snapshot the engine publishes whenever it changes.

Plain data (picklable, no sessions, no batchers): each model's versions and their states, and for every
ready version what a front end needs to serve it: its metadata (labels, input, preprocessing), its serving
settings and its execution provider. A front end resolves a request against the snapshot, decodes and
preprocesses with that version's metadata, then asks the engine to run the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from service.contract.model_config import ServingConfig
from service.contract.model_repository import ModelMetadata
from service.errors import NotFound, ServiceUnavailable

Phase = Literal["starting", "ready", "shutting_down", "stopped"]
Graph = Literal["classifier", "attention"]  # the graphs a version runs
# what running a request's rows gives: every output of the graph, each stacked over its images in order
Outputs = list[np.ndarray]


@dataclass(frozen=True)
class VersionView:
    """One ready model version, as a front end serves it."""

    name: str
    version: int
    metadata: ModelMetadata
    serving: ServingConfig
    provider: str
    attention: bool  # has an attention graph

    @cached_property
    def preprocessing_key(self) -> tuple[str, str]:
        """What decides the rows a request becomes: a version with the same key takes the same rows."""
        return (
            self.metadata.input.model_dump_json(),
            self.metadata.preprocessing.model_dump_json(),
        )


@dataclass(frozen=True)
class ModelView:
    name: str
    serving: ServingConfig | None
    # every version known: (state, reason); READY ones are also in ``ready``
    versions: dict[int, tuple[str, str]] = field(default_factory=dict)
    ready: dict[int, VersionView] = field(default_factory=dict)
    unloaded: bool = False
    problem: str = ""  # why its config.pbtxt on disk is refused, if it is

    def why_not_ready(self, version: int | None = None) -> str:
        """Why ``version`` (None: the model) is not ready, as the repository index says it."""
        if version is not None:
            state, reason = self.versions[version]
            return f"{state.lower()}: {reason}" if reason else state.lower()
        if self.problem and not self.versions:
            return f"unavailable: {self.problem}"
        reasons = [
            f"version {v} {state.lower()}" + (f": {reason}" if reason else "")
            for v, (state, reason) in sorted(self.versions.items())
        ]
        return "; ".join(reasons) or "unavailable"

    def ready_versions(self) -> list[int]:
        return sorted(self.ready)

    def view(self, version: int | None = None) -> VersionView | None:
        """The version a request for ``version`` goes to (the newest ready one for None)."""
        if version is None:
            return self.ready[max(self.ready)] if self.ready else None
        return self.ready.get(version)


@dataclass(frozen=True)
class ModelTable:
    generation: int = 0
    phase: Phase = "starting"
    default_name: str | None = None
    models: dict[str, ModelView] = field(default_factory=dict)
    retry_after_s: int = 1
    healthy: bool = False  # the default model's batchers are running
    explicit: bool = False  # model control 'explicit': what is not loaded waits to be asked for
    repository_names: frozenset[str] = frozenset()  # every model in the repository
    first_load: frozenset[str] = frozenset()  # the models start-up loads, while it runs

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.healthy

    def model(self, name: str | None) -> ModelView:
        if self.default_name is None:
            raise ServiceUnavailable(
                "the models are not loaded yet; retry shortly",
                code="not_ready",
                retry_after_s=self.retry_after_s,
            )
        name = name or self.default_name
        model = self.models.get(name)
        if model is None and name in self.first_load:
            # the engine publishes its table while its first load runs: a model it has not come
            # to yet is on its way, not unknown
            raise ServiceUnavailable(
                f"model {name!r} is not loaded yet (the engine is starting); retry shortly",
                code="not_ready",
                retry_after_s=self.retry_after_s,
            )
        if model is None and self.explicit and name in self.repository_names:
            raise not_loaded(name)
        if model is None:
            served = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"unknown model '{name}': served models: {served}", field="model")
        return model

    def resolve(self, name: str | None = None, version: int | None = None) -> VersionView:
        """The version a request goes to: 404 for an unknown model or version, 503 while loading."""
        model = self.model(name)
        view = model.view(version)
        if view is not None:
            return view
        if version is not None and version not in model.versions:
            ready = ", ".join(f"version {v}" for v in model.ready_versions()) or "none"
            raise NotFound(
                f"unknown version '{version}' of model '{model.name}' (ready: {ready})",
                field="version",
            )
        if model.unloaded or (self.explicit and not model.versions):
            raise not_loaded(model.name, model.problem)
        numbers = list(model.versions) if version is None else [version]
        loading = any(model.versions[number][0] == "LOADING" for number in numbers)
        raise ServiceUnavailable(
            f"model {model.name!r}{'' if version is None else f' version {version}'} is not ready "
            f"({model.why_not_ready(version)}){'; retry shortly' if loading else ''}",
            code="not_ready",
            retry_after_s=self.retry_after_s,
        )


def not_loaded(name: str, problem: str = "") -> NotFound:
    """Explicit mode: a model that is not loaded stays so until asked; retrying will not help.
    ``problem``: why its config.pbtxt is refused, which a load would meet."""
    refused = f"; its config is refused: {problem}" if problem else ""
    return NotFound(
        f"model '{name}' is not loaded (model control 'explicit': POST "
        f"/v2/repository/models/{name}/load loads it){refused}",
        field="model",
        code="model_not_loaded",
    )
