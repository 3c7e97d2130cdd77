"""What front ends and the engine say to each other.

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
its :class:`~service.contract.table.ModelTable`: on connecting, on change and as a heartbeat).

The table and what a call carries are the contract's (service/contract/table.py): the link carries
them, and neither it nor the front ends import ``service/engine/``; the engine's end of the link is the
engine's (service/engine/server.py). This module holds the messages' types only: their encoding, and
an answer's outputs to and from raw frames, are the codec's (service/link/wire.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from service import errors
from service.contract import control
from service.contract.control import ControlOp
from service.contract.table import Graph, ModelTable, ShadowMark
from service.errors import ServiceError

# bounds of what a message may hold: far above anything a front end sends, far below what would hurt
MAX_TEXT = 1024  # a model name, a request id, a trace header
MAX_DIMS = 8
MAX_DIM = 1 << 31

CallId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Shape = Annotated[
    tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)], ...], msgspec.Meta(max_length=MAX_DIMS)
]
Key = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # a version's rows, as table.py names them


class LinkViolation(ValueError):
    """A message that breaks the protocol: the link it came on is closed (nothing else is touched)."""


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
    """A control call: ``Engine.control(op, ...)`` with the arguments ``op`` takes
    (service/contract/control.py)."""

    call: CallId
    op: ControlOp
    name: Text | None = None
    version: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def arguments(self) -> dict[str, Any]:
        return control.arguments(self.op, self.name, self.version)


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
