"""The table of models the engine publishes and front ends route by, and what a call carries.

The table is plain data: each model's versions and their states and, for every ready version, what a
front end needs to serve it (its metadata, its serving settings, its execution provider). A front end
resolves a request against it (:meth:`ModelTable.route`), decodes and preprocesses with that version's
metadata, then asks the engine to run the rows; the engine builds it (service/engine/model_manager.py).
A call names the :data:`Graph` it runs, may carry a :class:`ShadowCopy` for the model's candidate, and
is answered with :data:`Outputs`.

Shared by both sides and by neither's code: the engine and the front ends import it, and the link
(service/link/protocol.py) carries it, so none of them imports another for it.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

import msgspec
import numpy as np

from service.contract.candidates import RowsPlan, in_canary
from service.contract.model_repository import ModelMetadata, rows_id
from service.errors import NotFound, ServiceUnavailable

if TYPE_CHECKING:  # the supervisor imports the link's addresses, and never grpc (tritonclient's)
    from service.contract.model_config import ServingConfig

Phase = Literal["starting", "ready", "shutting_down", "stopped"]
Graph = Literal["classifier", "attention"]  # the graphs a version runs
# what running a request's rows gives: every output of the graph, each stacked over its images in order
Outputs = list[np.ndarray]

# How a classifier call is shadowed on its model's candidate (the front end's draw, by the model's plan):
# "same": the candidate runs a copy of the call's rows; "own": the candidate's own rows (its own
# preprocessing) follow the call's; "incompatible": drawn, but the candidate cannot run this call (a
# tensor for another input, or a candidate with other labels): counted, never run.
ShadowMark = Literal["same", "own", "incompatible"]


class ShadowCopy(NamedTuple):
    """A call's shadow: its mark and, for "own", the candidate's rows of the same images."""

    mark: ShadowMark
    rows: np.ndarray | None = None


@dataclass(slots=True)
class Call:
    """One request as a front end hands it to the engine, built once (``ServedVersion._run``) and
    taken as it is by either engine client: the version it was routed to, the version the client
    asked for (None: the live one), the graph, the rows (one image each, preprocessed for the
    version), its id, what completes when its client has gone, and its copy for the candidate."""

    view: VersionView
    requested: int | None
    graph: Graph
    rows: np.ndarray
    request_id: str | None = None
    disconnected: Awaitable[object] | None = None
    shadow: ShadowCopy | None = None


class Serving(msgspec.Struct, frozen=True):
    """A version's serving settings, as a front end reports them (``ServingConfig`` in the engine)."""

    max_batch_size: Annotated[int, msgspec.Meta(ge=1)]
    max_queue_delay_s: Annotated[float, msgspec.Meta(ge=0)]
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] | None
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None
    instance_count: Annotated[int, msgspec.Meta(ge=1)]

    @classmethod
    def of(cls, config: ServingConfig) -> Serving:
        return cls(
            config.max_batch_size,
            config.max_queue_delay_s,
            tuple(config.preferred_batch_sizes),
            config.max_queue_size,
            config.request_timeout_s,
            config.instance_count,
        )


class VersionView(msgspec.Struct, frozen=True, dict=True):
    """One ready model version, as a front end serves it."""

    name: str
    version: int
    metadata: ModelMetadata
    serving: Serving
    provider: str
    attention: bool  # has an attention graph

    @cached_property
    def preprocessing_key(self) -> int:
        """What decides the rows a request becomes, as a 63-bit number each call carries and the
        engine compares: versions with the same key take the same rows (``rows_id`` of ``rows_fields``:
        equal in effect, whatever the metadata's text)."""
        return rows_id(self.metadata)

    @cached_property
    def row_shape(self) -> tuple[int, int, int]:
        """One image's row: ``(channels, height, width)`` of float32."""
        spec = self.metadata.input
        return (spec.channels, spec.height, spec.width)


class ModelView(msgspec.Struct, frozen=True):
    name: str
    # every version known: (state, reason); READY ones are also in ``ready``
    versions: dict[int, tuple[str, str]] = msgspec.field(default_factory=dict)
    ready: dict[int, VersionView] = msgspec.field(default_factory=dict)
    unloaded: bool = False
    problem: str = ""  # why its config.pbtxt on disk is refused, if it is
    # the version unversioned requests get (the engine's choice: service/contract/candidates.py)
    live: int | None = None
    # a candidate version on live traffic
    candidate: int | None = None
    canary_percent: float = 0.0
    shadow_percent: float = 0.0
    # how the candidate's shadow gets its rows (service/contract/candidates.py's ``shadow_rows``)
    shadow_rows: RowsPlan = "same"

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
        """The version a request for ``version`` goes to (the live one for None)."""
        if version is None:
            return None if self.live is None else self.ready.get(self.live)
        return self.ready.get(version)

    def shadow(self, version: int, images: bool) -> ShadowMark | None:
        """Whether a classifier call to ``version`` is shadowed on the candidate (a draw of the
        shadow share, for live calls only), and how its rows go; ``images``: the front end has the
        call's images and can prepare the candidate's own rows (a tensor call cannot)."""
        if self.shadow_percent <= 0 or version != self.live or self.candidate not in self.ready:
            return None
        if self.shadow_percent < 100 and random.random() * 100 >= self.shadow_percent:
            return None
        if self.shadow_rows == "same" or (self.shadow_rows == "own" and images):
            return self.shadow_rows
        return "incompatible"

    def canary(self, client_key: str | None) -> VersionView | None:
        """The candidate, when it answers this unversioned request (its canary share); else None."""
        candidate = self.ready.get(self.candidate) if self.candidate is not None else None
        if candidate is None or not in_canary(self.canary_percent, client_key):
            return None
        return candidate


class ModelTable(msgspec.Struct, frozen=True):
    generation: int = 0
    phase: Phase = "starting"
    default_name: str | None = None
    models: dict[str, ModelView] = msgspec.field(default_factory=dict)
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

    def route(
        self, name: str | None, version: int | None, client_key: str | None = None
    ) -> VersionView:
        """The version that answers a request: :meth:`resolve`'s, or for an unversioned request
        the model's candidate when its canary share picks it (sticky per ``client_key``)."""
        view = self.resolve(name, version)
        if version is None:
            model = self.models[view.name]
            if model.candidate is not None and model.candidate != view.version:
                return model.canary(client_key) or view
        return view


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
