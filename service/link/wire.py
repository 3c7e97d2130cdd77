"""The messages between front ends and the engine, over ZeroMQ.

A message is a multipart ZeroMQ message: a kind frame, a pickled header of plain values, and for tensors
raw frames (never pickled). Front end to engine: ``INFER`` (the rows are in the front end's shared-memory
arena, or inline in one raw frame when they did not fit), ``CANCEL`` (the client has gone), ``CONTROL``
(index, load, unload, config, statistics), ``TABLE`` (the table, now, to this front end) and ``FAILED``
(a request refused while decoding, for the version's statistics; no answer). Engine to front end: one
reply per call, ``(call_id, ok, payload)`` plus a raw frame per output; and on the table socket, the
engine's pid and its :class:`~service.engine.table.ModelTable` whenever it changes, and as a heartbeat.
Both ends are processes of one service started by one supervisor, over sockets in its private directory.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

from service import errors
from service.errors import ServiceError

INFER, CANCEL, CONTROL, TABLE, FAILED = b"I", b"X", b"C", b"T", b"F"
TABLE_CALL = 0  # the call id of the answer to TABLE (calls count from 1)


@dataclass(frozen=True)
class Addresses:
    """The engine's two sockets, in the supervisor's private run directory."""

    calls: str
    tables: str

    @classmethod
    def in_directory(cls, directory: str) -> Addresses:
        return cls(
            f"ipc://{os.path.join(directory, 'calls')}",
            f"ipc://{os.path.join(directory, 'tables')}",
        )


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


loads = pickle.loads


def error_payload(error: ServiceError) -> dict[str, Any]:
    return {
        "class": type(error).__name__,
        "message": error.message,
        "field": error.field,
        "code": error.code,
        "status_code": error.status_code,
        "headers": error.headers,
        "details": error.details,
    }


def error_from(payload: dict[str, Any]) -> ServiceError:
    """The engine's error, as the same class with the same fields."""
    cls = getattr(errors, payload["class"], ServiceError)
    if not (isinstance(cls, type) and issubclass(cls, ServiceError)):
        cls = ServiceError
    error = cls.__new__(cls)
    ServiceError.__init__(
        error,
        payload["message"],
        field=payload["field"],
        code=payload["code"],
        status_code=payload["status_code"],
        headers=payload["headers"],
        details=payload["details"],
    )
    return error


def output_frames(rows: list[tuple[np.ndarray, ...]]) -> tuple[list[tuple[str, tuple]], list]:
    """Each output stacked over the rows: its (dtype, shape) and its raw bytes."""
    stacked = [np.ascontiguousarray(np.stack(column)) for column in zip(*rows, strict=True)]
    return [(array.dtype.str, array.shape) for array in stacked], [array.data for array in stacked]


def output_rows(specs: list[tuple[str, tuple]], frames: list) -> list[tuple[np.ndarray, ...]]:
    outputs = [
        np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
        for (dtype, shape), frame in zip(specs, frames, strict=True)
    ]
    return list(zip(*outputs, strict=True)) if outputs else []
