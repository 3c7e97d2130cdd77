"""The messages between front ends and the engine, over ZeroMQ.

A message is a multipart ZeroMQ message that carries every item one side had ready in one turn of its
event loop (:class:`Outbox`): a first frame, the pickled list of the items' headers (plain values), then
the items' raw frames for tensors (never pickled). One message for many items matters: each ZeroMQ send
wakes the library's I/O thread, and under load that wake-up, not the copy, is the link's cost.

Front end to engine, an item's header is ``(kind, header)``: ``INFER`` (the rows are in the front end's
shared-memory arena, or inline in one raw frame when they did not fit), ``CANCEL`` (the client has gone),
``CONTROL`` (index, load, unload, config, statistics), ``TABLE`` (the table, now, to this front end) and
``FAILED`` (a request refused while decoding, for the version's statistics; no answer). Engine to front
end: one item per call, ``(call_id, ok, payload)`` plus a raw frame per output; and on the table socket,
the engine's pid and its :class:`~service.engine.table.ModelTable` whenever it changes, and as a heartbeat.
Both ends are processes of one service started by one supervisor, over sockets in its private directory.

The sockets are plain pyzmq sockets that the event loop reads through their file descriptor
(:class:`LoopSocket`), not ``zmq.asyncio``'s: its futures and poller cost more than the message itself
(``python -m bench.link_rtt``: a small message's round trip between two processes, about twice as long).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from service import errors
from service.errors import ServiceError

logger = logging.getLogger("vitserve")

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


def pack(items: list[tuple[Any, list]]) -> list:
    """Items ``(header, raw frames)`` as the frames of one message: the headers, then every raw frame."""
    frames: list = [dumps([(header, len(raw)) for header, raw in items])]
    for _, raw in items:
        frames.extend(raw)
    return frames


def unpack(frames: list) -> Iterator[tuple[Any, list]]:
    """The items of a message :func:`pack` made (its frames as received), in order."""
    at = 1
    for header, count in loads(frames[0].bytes):
        yield header, frames[at : at + count]
        at += count


# Linux's policy for threads that should not preempt their waker (None: not Linux)
SCHED_BATCH: int | None = getattr(os, "SCHED_BATCH", None)


def context() -> zmq.Context:
    """A ZeroMQ context whose I/O thread, woken by every send, does not take the core from the event
    loop that woke it mid-turn (BENCHMARKS.md: about 5% at c=64 on two cores)."""
    ctx = zmq.Context()
    if _may_batch():  # libzmq aborts the process where the policy cannot be set
        ctx.set(zmq.THREAD_SCHED_POLICY, SCHED_BATCH)
    return ctx


@functools.cache
def _may_batch() -> bool:
    """Whether a thread of this process may take SCHED_BATCH (a sandbox may refuse it)."""
    if SCHED_BATCH is None:
        return False
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, SCHED_BATCH, os.sched_param(0))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    thread = threading.Thread(target=probe, name="sched-probe")
    thread.start()
    thread.join()
    return allowed == [True]


class LoopSocket:
    """A ZeroMQ socket on the running event loop: each message that arrives goes to ``on_message``
    (its frames, not copied) as soon as the loop sees the socket readable; :meth:`send` never waits
    (the sockets have no high-water mark).

    ZeroMQ's descriptor is edge-triggered, and a send or a look at the socket's events can take the
    edge that a message arriving meanwhile would have raised: after each, the socket is drained once
    more from the loop, so no message waits for the next one to be seen.
    """

    # messages handed over in one go before the loop runs anything else
    DRAIN_BATCH = 256

    def __init__(self, socket: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None]) -> None:
        self.socket = socket
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._drain_scheduled = False
        self._loop.add_reader(socket.FD, self._drain)
        self._drain_soon()  # messages that came before the reader

    def send(self, frames: list) -> None:
        self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self._drain_soon()

    def close(self) -> None:
        if self.socket.closed:
            return
        self._loop.remove_reader(self.socket.FD)
        self.socket.close(linger=0)

    def _drain_soon(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        socket, on_message = self.socket, self._on_message
        for _ in range(self.DRAIN_BATCH):
            if socket.closed or not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                on_message(frames)
            except Exception:  # one bad message must not stop the link
                logger.exception("a message from the other process could not be handled")
        self._drain_soon()  # more are waiting: the rest after what else the loop has ready


class Outbox:
    """Items to send on a ZeroMQ socket, sent together once the event loop has run what is ready; an
    item put ``at_once`` (a lone call, or its answer: nothing else in flight) goes now when nothing
    waits before it, since no partner will join it this turn (at c=1 the wait for the loop's next turn
    was a third of the hop: BENCHMARKS.md).

    ``prefix`` is the frames each message starts with (a ROUTER's peer identity); an outbox per peer.
    """

    def __init__(self, send: Callable[[list], None], prefix: tuple = ()) -> None:
        self._send = send
        self._prefix = list(prefix)
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
            self._send(self._prefix + pack(items))
        except zmq.ZMQError as error:
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
