"""The engine's control operations: each one's arguments and the type of its value, in one table.

Everything else follows it: the link's :class:`~service.link.protocol.Remote` message (its ``op`` is
checked against :data:`ControlOp` as it is decoded) and the decoding of its value
(``wire.result_value``), the keyword arguments ``Engine.control`` is called with (:func:`arguments`,
both in the engine process and in a front end's own), and the unknown-operation error of the engine's
dispatch (service/engine/core.py). A new operation is a row here, a handler there, and a method of
``service/link/client.py``'s ``EngineClient``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Argument = Literal["name", "version"]


class Operation(NamedTuple):
    takes: tuple[Argument, ...]  # the keyword arguments Engine.control gets for it
    answers: Any  # its value's type, checked as the front end decodes it (None: no value)


OPERATIONS: dict[str, Operation] = {
    "index": Operation((), list[tuple[str, int | None, str, str]]),
    "load": Operation(("name",), None),
    "unload": Operation(("name",), None),
    "config": Operation(("name", "version"), dict[str, Any]),
    "statistics": Operation(("name", "version"), list[dict[str, Any]]),
    "metrics": Operation((), None),
    "shadow": Operation(("name",), dict[str, Any]),
    "promote": Operation(("name", "version"), dict[str, Any]),
    "rollback": Operation(("name",), dict[str, Any]),
}

# the operations' names as a type, made from the table (msgspec refuses any other name on the link)
ControlOp = Literal[tuple(OPERATIONS)]  # type: ignore[valid-type]


def arguments(op: str, name: str | None, version: int | None) -> dict[str, Any]:
    """The keyword arguments ``Engine.control(op, ...)`` is called with: those ``op`` takes."""
    given = {"name": name, "version": version}
    return {argument: given[argument] for argument in OPERATIONS[op].takes}
