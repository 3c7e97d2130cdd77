"""The engine process's end of the link: a Unix socket every front end connects to.

The calls that arrive in one turn of the engine's event loop, from every front end, are queued together
in the next, so the batcher fills its batches from all of them: the calls of one route together, the
version resolved once. A call that came alone, with nothing else in progress, may run there and then
and be answered at once (a lone image of a fast model). Every call is one
:class:`~service.engine.request.Request` and ends the same way, inline, batched or refused: its reply
puts the answer in its front end's outbox; no task and no future per call. The answers a batch
completes go back to each front end in one message. Each front end gets the table when it connects,
whenever it changes (looked at every ``TABLE_CHECK_S``) and at least every ``HEARTBEAT_S``. A front end
whose connection ends (it died) has its calls cancelled: their rows still queued never run.

What a front end sends is checked before it is used (``service/link/protocol.py`` checks each field's
type and range as it decodes): its arena must be the block the process on the other end of the socket
would own; a call's rows must lie inside that block, or fill its one raw frame, and be float32 of the
version's input shape (``ModelPipeline.submit``). A call that fails a check is refused on its own (an
error answer); a message that breaks the protocol (undecodable, a duplicate call id, a call before
the front end said hello) closes its sender's link. Either way nothing of another call, or of another
front end, is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
import numpy as np

from service.contract.table import Outputs, ShadowCopy
from service.engine.core import Engine, Route
from service.engine.request import Request
from service.errors import ClientDisconnected, InferenceFailed, ServiceError
from service.link import wire
from service.link.arena import ArenaReader, expected_block
from service.link.protocol import (
    Cancel,
    ErrorInfo,
    Failed,
    Hello,
    Infer,
    LinkViolation,
    Refusal,
    Remote,
    Result,
    TableUpdate,
)
from service.observability import tracing

logger = logging.getLogger("vitserve")

# how often the engine looks for a change of its table: as often as it writes its readiness for the
# health port (ENGINE_BEAT_S); a control call's change goes at once. Each look wakes the idle engine.
TABLE_CHECK_S = 0.1
HEARTBEAT_S = 0.5
ROW_DTYPE = np.dtype(np.float32)  # every version's input (the model contract's InputSpec)
ROW_DTYPE_TEXT = ROW_DTYPE.str  # as a call names it (``dtype.str`` formats it anew at each use)
_PEER = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


CANCELLED = object()  # a call whose client went away before it started: it never runs


def bad_call(message: str) -> ServiceError:
    return ServiceError(message, status_code=400, code="bad_call", field="rows")


class EngineServer:
    def __init__(
        self, engine: Engine, addresses: wire.Addresses, supervisor_pid: int | None = None
    ) -> None:
        self.engine = engine
        self.addresses = addresses
        # the front ends' arenas carry the supervisor's pid (the engine's parent)
        self._supervisor_pid = os.getppid() if supervisor_pid is None else supervisor_pid
        self._server: asyncio.AbstractServer | None = None
        self._links: set[wire.Link] = set()  # one per front end that said hello
        self._reader = ArenaReader()
        self._arenas: dict[wire.Link, str] = {}  # each front end's shared-memory block
        # the calls in progress (None: arrived, not started yet; CANCELLED: cancelled before that)
        self._calls: dict[tuple[wire.Link, int], Request | object | None] = {}
        self._arrived: list[tuple[wire.Link, Infer, list]] = []  # calls to start
        self._running: set[asyncio.Task] = set()  # control calls
        self._publish_now = asyncio.Event()  # a control call may have changed the table
        self._publish_due = asyncio.Event()  # the next look at the table is due
        self._tasks: list[asyncio.Task] = []
        # sent with every table: a restarted engine that got its predecessor's pid is still new
        self._process = (os.getpid(), time.time_ns())

    async def bind(self) -> None:
        path = self.addresses.engine
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the socket of an engine that died
        loop = asyncio.get_running_loop()
        with wire.socket_path(path) as address:
            self._server = await loop.create_unix_server(
                lambda: wire.Link(
                    wire.to_engine,
                    self.take,
                    self._lost,
                    unsendable=_refusal_instead,
                    bound_unread=True,
                ),
                address,
            )
        self._tasks = [loop.create_task(self._publish(), name="engine-tables")]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for link in list(self._links):
            link.close()
        self._reader.close()

    def _table_update(self) -> TableUpdate:
        return TableUpdate(*self._process, self.engine.table())

    async def _publish(self) -> None:
        """The table to every front end when it has changed (looked at every ``TABLE_CHECK_S``, or
        at once when ``_publish_now`` is set) and at least every ``HEARTBEAT_S``. A timer wakes it,
        not ``wait_for``: a task and its cancellation every few milliseconds cost more than the look."""
        published, last = -1, 0.0
        loop = asyncio.get_running_loop()
        while True:
            update = self._table_update()
            now = loop.time()
            if update.table.generation != published or now - last >= HEARTBEAT_S:
                for link in self._links:
                    link.outbox.put(update)
                published, last = update.table.generation, now
            self._publish_now.clear()
            timer = loop.call_later(TABLE_CHECK_S, self._publish_due.set)
            try:
                await self._publish_due.wait()
            finally:
                timer.cancel()
            self._publish_due.clear()
            if self._publish_now.is_set():
                published = -1

    def _lost(self, link: wire.Link) -> None:
        """A front end went away: nobody will read its answers, so its calls need not run, and its
        shared memory is let go (a block still holding queued rows goes with them)."""
        self._links.discard(link)
        name = self._arenas.pop(link, None)
        if name is not None:
            self._reader.forget(name)
        for key in [key for key in self._calls if key[0] is link]:
            self._cancel(key)

    # --- what arrives -------------------------------------------------------------------------------

    def take(self, link: wire.Link, items: list[wire.Item]) -> None:
        """The items of one message from a front end, in order."""
        for message, raw in items:
            kind = type(message)
            if kind is Infer:
                self._arrive(link, message, raw)
            elif kind is Cancel:
                self._cancel((link, message.call))
            elif kind is Failed:
                self.engine.record_failure(message.name, message.version, message.ns)
            elif kind is Remote:
                self._track(self._control(link, message))
            elif kind is Hello:
                self._hello(link, message)

    def _hello(self, link: wire.Link, hello: Hello) -> None:
        """A front end connecting: its arena, checked and mapped; the table to it now, and from now
        on."""
        if link in self._links:
            raise LinkViolation("a second hello on one link")
        if hello.arena is not None:
            pid = _peer_pid(link)
            if pid is None or not expected_block(hello.arena, self._supervisor_pid, pid):
                raise LinkViolation(
                    f"the arena {hello.arena!r} is not the block of this service's front end in "
                    f"process {pid}"
                )
            try:
                self._reader.open(hello.arena)
            except (OSError, ValueError) as error:
                raise LinkViolation(
                    f"the arena {hello.arena!r} cannot be mapped: {error}"
                ) from None
            self._arenas[link] = hello.arena
        self._links.add(link)
        link.outbox.put(self._table_update())

    def _arrive(self, link: wire.Link, message: Infer, raw: list) -> None:
        if link not in self._links:
            raise LinkViolation("a call before the front end said hello")
        key = (link, message.call)
        if key in self._calls:
            raise LinkViolation(f"call id {message.call} is already in progress")
        self._calls[key] = None  # registered now: a cancel in the same message finds it
        self._arrived.append((link, message, raw))
        if len(self._arrived) == 1:
            asyncio.get_running_loop().call_soon(self._start_arrived)

    def _cancel(self, key: tuple[wire.Link, int]) -> None:
        """The client of a call has gone: its rows still queued never run."""
        call = self._calls.get(key)
        if call is None:
            if key in self._calls:  # not started yet: it is, and then cancelled
                self._calls[key] = CANCELLED
        elif call is not CANCELLED:
            call.cancel()  # type: ignore[union-attr]

    def _rows(self, link: wire.Link, message: Infer, raw: list) -> np.ndarray:
        """A call's rows (and the candidate's own after them, for a shadow marked "own"), read where
        it says they are, as one flat buffer; a 400 when they are not there."""
        if message.dtype != ROW_DTYPE_TEXT:
            raise bad_call(f"rows of dtype {message.dtype!r}; the engine takes float32 rows")
        if (message.shadow == "own") != (message.shadow_shape is not None):
            raise bad_call("a shadow marked 'own' carries the candidate's rows, and only it")
        shape = message.shape
        if message.shadow_shape is not None:
            shape = (math.prod(shape) + math.prod(message.shadow_shape),)
        if message.offset is None:
            nbytes = math.prod(shape) * ROW_DTYPE.itemsize
            if len(raw) != 1 or len(raw[0]) != nbytes:
                raise bad_call(f"rows of shape {shape} need one frame of {nbytes} bytes")
            return np.frombuffer(raw[0], ROW_DTYPE).reshape(shape)
        name = self._arenas.get(link)
        if name is None:
            raise bad_call("rows in an arena, from a front end that has none")
        try:
            return self._reader.rows(name, message.offset, shape, ROW_DTYPE)
        except ValueError as error:
            raise bad_call(str(error)) from None

    # --- calls and answers --------------------------------------------------------------------------

    def _track(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _answer(self, link: wire.Link, message: Any, *frames: Any) -> None:
        # the answer to the only call in progress has no partner to wait for
        alone = len(self._calls) + len(self._running) <= 1
        link.outbox.put(message, *frames, at_once=alone)

    def _answer_error(
        self, link: wire.Link, call_id: int, request_id: str | None, error: Exception
    ) -> None:
        if not isinstance(error, ServiceError):
            logger.error("engine call %s [request %s] failed", call_id, request_id, exc_info=error)
            error = InferenceFailed(f"the engine failed on this request ({type(error).__name__})")
        self._answer(link, Refusal(call_id, ErrorInfo.of(error)))

    def _start_arrived(self) -> None:
        """Queue the calls that arrived in the last turn of the loop: those of one route (model,
        version, graph) together, the version resolved once for them (``Engine.submit``). One that
        came alone, with nothing else in progress, runs at once on an idle model."""
        arrived, self._arrived = self._arrived, []
        alone = len(arrived) == 1 and len(self._calls) == 1 and not self._running
        routes: dict[Route, list[Request]] = {}
        reply = self._reply
        for link, message, raw in arrived:
            key = (link, message.call)
            if self._calls[key] is CANCELLED or link.closing:
                # its client went away (or its front end broke the protocol) before it started:
                # it never runs, not even inline (a lone image runs before submit returns)
                del self._calls[key]
                self._answer(link, Refusal(message.call, ErrorInfo.of(_not_run(message))))
                continue
            try:
                rows = self._rows(link, message, raw)
            except Exception as error:
                del self._calls[key]
                self._answer_error(link, message.call, message.request_id, error)
                continue
            shadow = None
            if message.shadow_shape is not None:  # the call's rows, then the candidate's
                size = math.prod(message.shape)
                own = rows[size:].reshape(message.shadow_shape)
                rows = rows[:size].reshape(message.shape)
                shadow = ShadowCopy("own", own)
            elif message.shadow is not None:
                shadow = ShadowCopy(message.shadow)
            request = Request(rows, reply, message.request_id, key)
            request.shadow = shadow
            self._calls[key] = request
            route = Route(
                message.name, message.version, message.requested, message.key, message.graph
            )
            if message.trace is None:
                routes.setdefault(route, []).append(request)
            else:  # queued on its own, in its caller's trace
                with tracing.attached(message.trace):
                    self._submit(route, [request], alone)
        for route, requests in routes.items():
            self._submit(route, requests, alone)

    def _submit(self, route: Route, requests: list[Request], alone: bool) -> None:
        try:
            self.engine.submit(route, requests, alone)
        except Exception as error:  # a fault of the engine's: these calls alone are answered
            for request in requests:
                request.fail(error)

    def _reply(self, request: Request, outputs: Outputs | None, error: Exception | None) -> None:
        """A call has ended: its answer into its front end's outbox."""
        link, call_id = request.tag
        if outputs is not None:
            answer, frames = wire.answer_frames(call_id, outputs)
            self._answer(link, answer, *frames)
        else:
            self._answer_error(link, call_id, request.request_id, error)  # type: ignore[arg-type]
        self._calls.pop(request.tag, None)

    async def _control(self, link: wire.Link, message: Remote) -> None:
        try:
            value = await self.engine.control(message.op, **message.arguments())
            answer: Any = Result(message.call, msgspec.Raw(wire.encoder.encode(value)))
        except ServiceError as error:
            answer = Refusal(message.call, ErrorInfo.of(error))
        except Exception as error:
            logger.exception("engine control %s failed", message.op)
            failure = ServiceError(f"the engine failed on {message.op} ({type(error).__name__})")
            answer = Refusal(message.call, ErrorInfo.of(failure))
        self._answer(link, answer)
        self._publish_now.set()  # a load or unload changes the table
        self._publish_due.set()


def _not_run(message: Infer) -> ClientDisconnected:
    images = message.shape[0] if message.shape else 0
    return ClientDisconnected(
        f"the client went away before the request started; none of its {images} images were run"
    )


def _refusal_instead(message: Any, error: Exception) -> wire.Item | None:
    """An answer or a result that cannot be encoded (a number beyond msgpack's 64 bits): its call is
    refused instead, so its caller is answered and the rest of the message goes. A table that cannot
    be sent is dropped (logged by the outbox); the next one goes."""
    call = getattr(message, "call", None)
    if call is None or isinstance(message, Refusal):
        return None
    failure = ServiceError(
        f"the engine's answer to this call cannot be sent ({type(error).__name__}: {error})",
        code="unsendable_answer",
    )
    return (Refusal(call, ErrorInfo.of(failure)), [])


def _peer_pid(link: wire.Link) -> int | None:
    """The pid of the process on the other end of ``link``'s Unix socket (the kernel's word)."""
    sock = link.transport.get_extra_info("socket") if link.transport is not None else None
    if sock is None:
        return None
    try:
        pid, _, _ = _PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))
    except OSError:
        return None
    return pid
