"""What front ends and the engine say to each other, and the table of models they share.

Every message on the link is one of the typed structs below, encoded with msgpack (msgspec) and checked
field by field as it is decoded: a wrong type, a missing field, a value out of its range or an unknown
kind of message is refused there (``LinkViolation``), before the engine acts on any of it. Tensors never
go through msgpack: they travel as raw frames beside the header (``service/link/wire.py``), or in the
front end's shared-memory arena, of which only the place travels.

Front end to engine: :class:`Hello` (on connecting: the front end's arena; the engine's tables follow),
:class:`Infer` (a request's rows), :class:`Cancel` (its client went away), :class:`Failed` (a request
refused while decoding, for the version's statistics) and :class:`Remote` (a control call). Engine to
front end: :class:`Answer` (every output, as raw frames), :class:`Refusal` (a :class:`ServiceError`),
:class:`Result` (a control call's value) and :class:`TableUpdate` (the engine's pid, its start and
its :class:`ModelTable`: on connecting, on change and as a heartbeat).

The table is plain data: each model's versions and their states and, for every ready version, what a
front end needs to serve it (its metadata, its serving settings, its execution provider). A front end
resolves a request against it, decodes and preprocesses with that version's metadata, then asks the
engine to run the rows. Front ends import this module, never ``service/engine/``.
"""

from __future__ import annotations

import random
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
from pydantic import BaseModel

from service import errors
from service.contract.candidates import RowsPlan, in_canary
from service.contract.model_repository import ModelMetadata, rows_key
from service.errors import NotFound, ServiceError, ServiceUnavailable

if TYPE_CHECKING:  # the supervisor imports the link's addresses, and never grpc (tritonclient's)
    from service.contract.model_config import ServingConfig

Phase = Literal["starting", "ready", "shutting_down", "stopped"]
Graph = Literal["classifier", "attention"]  # the graphs a version runs
# what running a request's rows gives: every output of the graph, each stacked over its images in order
Outputs = list[np.ndarray]
ControlOp = Literal[
    "index", "load", "unload", "config", "statistics", "metrics", "shadow", "promote", "rollback"
]

# bounds of what a message may hold: far above anything a front end sends, far below what would hurt
MAX_TEXT = 1024  # a model name, a request id, a trace header
MAX_KEY = 1 << 20  # a version's preprocessing key (its rows' shape and preprocessing as JSON)
MAX_DIMS = 8
MAX_DIM = 1 << 31

CallId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Shape = Annotated[
    tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)], ...], msgspec.Meta(max_length=MAX_DIMS)
]
Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY)]
# How a classifier call is shadowed on its model's candidate (the front end's draw, by the model's plan):
# "same": the candidate runs a copy of the call's rows; "own": the candidate's own rows (its own
# preprocessing) follow the call's; "incompatible": drawn, but the candidate cannot run this call (a
# tensor for another input, or a candidate with other labels): counted, never run.
ShadowMark = Literal["same", "own", "incompatible"]


class ShadowCopy(NamedTuple):
    """A call's shadow: its mark and, for "own", the candidate's rows of the same images."""

    mark: ShadowMark
    rows: np.ndarray | None = None


class LinkViolation(ValueError):
    """A message that breaks the protocol: the link it came on is closed (nothing else is touched)."""


# --- the table --------------------------------------------------------------------------------------


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
    def preprocessing_key(self) -> str:
        """What decides the rows a request becomes: a version with the same key takes the same rows
        (``rows_key``: equal in effect, whatever the metadata's text)."""
        return rows_key(self.metadata)

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


# --- front end to engine ----------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """A front end connecting: the name of its shared-memory arena (None: it has none)."""

    arena: Text | None


class Infer(msgspec.Struct, tag="infer", array_like=True, frozen=True):
    """Run ``rows`` (one image each, preprocessed for the version) on ``graph``. The rows are in the
    sender's arena at ``offset``, or, for ``offset`` None, the message's one raw frame."""

    call: CallId
    name: Text
    version: Annotated[int, msgspec.Meta(ge=0)]
    requested: Annotated[int, msgspec.Meta(ge=0)] | None
    key: Key
    graph: Graph
    shape: Shape
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    offset: Annotated[int, msgspec.Meta(ge=0)] | None
    request_id: Text | None = None
    trace: dict[Text, Text] | None = None
    shadow: ShadowMark | None = None
    # "own": the candidate's rows follow the call's, in the same arena region or frame
    shadow_shape: Shape | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    call: CallId


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """A request for this version was refused while decoding, after ``ns`` nanoseconds."""

    name: Text
    version: Annotated[int, msgspec.Meta(ge=0)]
    ns: Annotated[int, msgspec.Meta(ge=0)]


class Remote(msgspec.Struct, tag="remote", array_like=True, frozen=True):
    """A control call: ``Engine.control(op, name=..., version=...)``."""

    call: CallId
    op: ControlOp
    name: Text | None = None
    version: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def arguments(self) -> dict[str, Any]:
        if self.op in ("load", "unload", "shadow", "rollback"):
            return {"name": self.name}
        if self.op == "promote":
            return {"name": self.name, "version": self.version}
        if self.op in ("config", "statistics"):
            return {"name": self.name, "version": self.version}
        return {}


ToEngine = Hello | Infer | Cancel | Failed | Remote


# --- engine to front end ----------------------------------------------------------------------------


class Answer(msgspec.Struct, tag="answer", array_like=True, frozen=True):
    """A call's outputs: each one's dtype and shape here, its bytes in the raw frames, in order."""

    call: CallId
    outputs: list[tuple[Annotated[str, msgspec.Meta(max_length=16)], Shape]]


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True):
    kind: str  # the ServiceError subclass's name
    message: str
    field: str | None
    code: str
    status_code: Annotated[int, msgspec.Meta(ge=100, le=599)]
    headers: dict[str, str]
    details: list[dict[str, Any]] | None

    @classmethod
    def of(cls, error: ServiceError) -> ErrorInfo:
        return cls(
            type(error).__name__,
            error.message,
            error.field,
            error.code,
            error.status_code,
            error.headers,
            error.details,
        )

    def error(self) -> ServiceError:
        """The engine's error, as the same class with the same fields."""
        kind = getattr(errors, self.kind, ServiceError)
        if not (isinstance(kind, type) and issubclass(kind, ServiceError)):
            kind = ServiceError
        error = kind.__new__(kind)
        ServiceError.__init__(
            error,
            self.message,
            field=self.field,
            code=self.code,
            status_code=self.status_code,
            headers=self.headers,
            details=self.details,
        )
        return error


class Refusal(msgspec.Struct, tag="refusal", array_like=True, frozen=True):
    call: CallId
    error: ErrorInfo


class Result(msgspec.Struct, tag="result", array_like=True, frozen=True):
    """A control call's value, still encoded: its caller decodes it as its operation's type."""

    call: CallId
    value: msgspec.Raw


class TableUpdate(msgspec.Struct, tag="table", array_like=True, frozen=True):
    pid: int
    started: int  # the engine process's start, ns: a restarted engine on a reused pid is still new
    table: ModelTable


ToFrontEnd = Answer | Refusal | Result | TableUpdate

# what each control call answers (checked as the front end decodes it)
RESULT_TYPES: dict[str, Any] = {
    "index": list[tuple[str, int | None, str, str]],
    "config": dict[str, Any],
    "statistics": list[dict[str, Any]],
    "load": None,
    "unload": None,
    "metrics": None,
    "shadow": dict[str, Any],
    "promote": dict[str, Any],
    "rollback": dict[str, Any],
}


# --- encoding ---------------------------------------------------------------------------------------


def _encode_hook(value: Any) -> Any:
    if isinstance(value, BaseModel):  # a version's metadata
        return value.model_dump(mode="json")
    raise NotImplementedError(f"{type(value).__name__} cannot travel on the link")


def _decode_hook(kind: type, value: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(value)
    raise NotImplementedError(f"{kind} cannot travel on the link")


encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
# a message's items: each with its raw frames' lengths
FrameLengths = list[Annotated[int, msgspec.Meta(ge=0)]]
to_engine = msgspec.msgpack.Decoder(list[tuple[ToEngine, FrameLengths]], dec_hook=_decode_hook)
to_front_end = msgspec.msgpack.Decoder(list[tuple[ToFrontEnd, FrameLengths]], dec_hook=_decode_hook)


def result_value(op: str, raw: msgspec.Raw) -> Any:
    """A control call's value, checked against its operation's type."""
    return msgspec.msgpack.decode(raw, type=RESULT_TYPES[op])


# each output dtype's text, for the few dtypes models answer in (``dtype.str`` formats a new string
# at every call, with libc's printf)
_DTYPE_TEXT: dict[np.dtype, str] = {}


def answer_frames(call: int, outputs: Outputs) -> tuple[Answer, list]:
    """The answer to ``call`` and its outputs' raw bytes (a request's rows of a batch's outputs are
    contiguous already: no copy)."""
    shapes, frames = [], []
    for output in outputs:
        frame = np.ascontiguousarray(output)
        dtype = frame.dtype
        text = _DTYPE_TEXT.get(dtype)
        if text is None:
            text = _DTYPE_TEXT[dtype] = dtype.str
        shapes.append((text, frame.shape))
        frames.append(frame)
    return Answer(call, shapes), frames


def answer_outputs(answer: Answer, frames: list) -> Outputs:
    """An answer's outputs; a frame whose length does not match its shape is a violation."""
    try:
        return [
            np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
            for (dtype, shape), frame in zip(answer.outputs, frames, strict=True)
        ]
    except (TypeError, ValueError) as error:
        raise LinkViolation(f"answer {answer.call}: {error}") from None
