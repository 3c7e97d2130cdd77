"""The messages between front ends and the engine, over one Unix socket per front end.

A message carries every item one side had ready in one turn of its event loop (:class:`Outbox`): a
prefix of two lengths, the pickled list of the items' headers (plain values, each with its raw frames'
lengths), then the items' raw frames for tensors (never pickled). One message for many items matters:
under load each write and each wake-up of the other side, not the copy, is the link's cost.

Front end to engine, an item's header is ``(kind, header)``: ``INFER`` (the rows are in the front end's
shared-memory arena, or inline in one raw frame when they did not fit), ``CANCEL`` (the client has gone),
``CONTROL`` (index, load, unload, config, statistics), ``TABLE`` (sent on connecting: the table now,
and every table from then on) and ``FAILED`` (a request refused while decoding, for the version's
statistics; no answer). Engine to front end: one item per call, ``(call_id, ok, payload)`` plus a raw
frame per output; and, as the answers to call ``TABLE_CALL``, the engine's pid and its
:class:`~service.engine.table.ModelTable` at once, whenever it changes, and as a heartbeat. Both ends
are processes of one service started by one supervisor, over a socket in its private directory.

The sockets are asyncio's own Unix-socket transports (:class:`Link`), not ZeroMQ's: ZeroMQ hands every
message to an I/O thread on each side, and between processes left idle by a lone client those wake-ups
made a round trip about 1.6x as long (``python -m bench.link_rtt --gap-ms 1``: BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service import errors
from service.errors import ServiceError

if TYPE_CHECKING:
    from service.engine.table import Outputs

logger = logging.getLogger("vitserve")

INFER, CANCEL, CONTROL, TABLE, FAILED = b"I", b"X", b"C", b"T", b"F"
TABLE_CALL = 0  # the call id the engine's tables come under (calls count from 1)

# a message's first bytes: its headers' length, then its raw frames' length
_PREFIX = struct.Struct("<QQ")


@dataclass(frozen=True)
class Addresses:
    """Where the engine listens: a Unix socket in the supervisor's private run directory."""

    engine: str

    @classmethod
    def in_directory(cls, directory: str) -> Addresses:
        return cls(os.path.join(directory, "engine"))


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


loads = pickle.loads


def pack(items: list[tuple[Any, list]]) -> bytes:
    """Items ``(header, raw frames)`` as one message, to be written in one go (uvloop's
    ``writelines`` wrote each buffer apart and woke the reader for each: a round trip took twice as
    long)."""
    headers, raw = [], []
    for header, frames in items:
        views = [memoryview(frame).cast("B") for frame in frames]
        headers.append((header, [len(view) for view in views]))
        raw.extend(views)
    packed = dumps(headers)
    return b"".join([_PREFIX.pack(len(packed), sum(len(view) for view in raw)), packed, *raw])


def unpack(message: memoryview) -> Iterator[tuple[Any, list[memoryview]]]:
    """The items of one whole message (prefix included), in order, each with its raw frames as views
    of ``message``."""
    header_bytes, _ = _PREFIX.unpack_from(message)
    at = _PREFIX.size + header_bytes
    for header, lengths in loads(message[_PREFIX.size : at]):
        raw = []
        for length in lengths:
            raw.append(message[at : at + length])
            at += length
        yield header, raw


def split(data: memoryview) -> tuple[list[memoryview], int]:
    """The whole messages at the start of ``data``, and how many of its bytes they take."""
    messages, at = [], 0
    while len(data) - at >= _PREFIX.size:
        header_bytes, raw_bytes = _PREFIX.unpack_from(data, at)
        end = at + _PREFIX.size + header_bytes + raw_bytes
        if end > len(data):
            break
        messages.append(data[at:end])
        at = end
    return messages, at


class Link(asyncio.Protocol):
    """One end of a front end's connection to the engine: each item of each message that arrives goes
    to ``on_item(link, header, raw)`` in order; ``outbox`` sends. ``on_lost(link)`` runs once, when the
    connection has ended (the other process closed it, or died)."""

    def __init__(
        self,
        on_item: Callable[[Link, Any, list[memoryview]], None],
        on_lost: Callable[[Link], None] | None = None,
    ) -> None:
        self._on_item = on_item
        self._on_lost = on_lost
        self._partial = bytearray()  # the start of a message still arriving
        self.transport: Any = None  # an asyncio.Transport (uvloop's are not its subclasses)
        self.outbox = Outbox(self._write)
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._on_lost is not None:
            self._on_lost(self)

    def close(self) -> None:
        self.outbox.flush()
        if self.transport is not None:
            self.transport.close()

    def _write(self, message: bytes) -> None:
        if self.open:
            self.transport.write(message)

    def data_received(self, data: bytes) -> None:
        if self._partial:  # the rest of a message: whole ones are copied out of the buffer
            self._partial += data
            with memoryview(self._partial) as view:
                messages, used = split(view)
                messages = [memoryview(bytes(message)) for message in messages]
            del self._partial[:used]
        else:  # the usual case: whole messages, read in place
            messages, used = split(memoryview(data))
            if used < len(data):
                self._partial += data[used:]
        for message in messages:
            try:
                items = list(unpack(message))
            except Exception:  # the lengths were read, so the next message still starts right
                logger.exception("a message from the other process could not be read")
                continue
            for header, raw in items:
                try:
                    self._on_item(self, header, raw)
                except Exception:  # one bad item must not stop the link
                    logger.exception("a message from the other process could not be handled")


class Outbox:
    """Items to send on a link, sent together once the event loop has run what is ready; an item put
    ``at_once`` (a lone call, or its answer: nothing else in flight) goes now when nothing waits before
    it, since no partner will join it this turn (at c=1 the wait for the loop's next turn was a third
    of the hop: BENCHMARKS.md)."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._items: list[tuple[Any, list]] = []

    def put(self, header: Any, *raw: Any, at_once: bool = False) -> None:
        first = not self._items  # else a flush is due this turn, and this item goes with it
        self._items.append((header, list(raw)))
        if first and at_once:
            self.flush()
        elif first:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        items, self._items = self._items, []
        if not items:
            return
        try:
            self._send(pack(items))
        except Exception as error:
            logger.error("a message to the other process was not sent: %r", error)


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


def output_frames(outputs: Outputs) -> tuple[list[tuple[str, tuple]], list]:
    """Each output's (dtype, shape) and its raw bytes (a request's rows of a batch's outputs are
    contiguous already: no copy)."""
    arrays = [np.ascontiguousarray(output) for output in outputs]
    return [(array.dtype.str, array.shape) for array in arrays], [array.data for array in arrays]


def outputs_from(specs: list[tuple[str, tuple]], frames: list) -> Outputs:
    return [
        np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
        for (dtype, shape), frame in zip(specs, frames, strict=True)
    ]
