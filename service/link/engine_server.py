"""The engine process's end of the link: calls from every front end on a ROUTER, tables on a PUB socket.

Each call runs as its own task on the engine's event loop, so the batcher sees the rows of every front end
at once and fills its batches from all of them; the answers a batch completes go back to each front end in
one message. The table is published whenever it changes (looked at
every ``TABLE_CHECK_S``) and at least every ``HEARTBEAT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import zmq

from service.engine.core import Engine
from service.errors import InferenceFailed, ServiceError
from service.link import wire
from service.link.arena import ArenaReader
from service.observability import tracing

logger = logging.getLogger("vitserve")

TABLE_CHECK_S = 0.02
HEARTBEAT_S = 0.5


class EngineServer:
    def __init__(self, engine: Engine, addresses: wire.Addresses) -> None:
        self.engine = engine
        self.addresses = addresses
        self._context = wire.context()
        self._router = self._context.socket(zmq.ROUTER)
        self._tables = self._context.socket(zmq.PUB)
        for socket in (self._router, self._tables):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
        self._calls: wire.LoopSocket | None = None
        self._reader = ArenaReader()
        self._gone: dict[tuple[bytes, int], asyncio.Future] = {}  # a call's client-gone signal
        self._running: set[asyncio.Task] = set()
        self._outboxes: dict[bytes, wire.Outbox] = {}  # a front end's answers, by its identity
        self._publish_now = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # sent with every table: a restarted engine that got its predecessor's pid is still new
        self._process = (os.getpid(), time.time_ns())

    def bind(self) -> None:
        self._router.bind(self.addresses.calls)
        self._tables.bind(self.addresses.tables)
        self._calls = wire.LoopSocket(self._router, self._receive)
        self._tasks = [
            asyncio.get_running_loop().create_task(self._publish(), name="engine-tables")
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for outbox in self._outboxes.values():
            outbox.flush()
        if self._calls is not None:
            self._calls.close()
        self._context.destroy(linger=0)
        self._reader.close()

    async def _publish(self) -> None:
        published, last = -1, 0.0
        loop = asyncio.get_running_loop()
        while True:
            table = self.engine.table()
            now = loop.time()
            if table.generation != published or now - last >= HEARTBEAT_S:
                self._tables.send(wire.dumps((self._process, table)), zmq.NOBLOCK)
                published, last = table.generation, now
            self._publish_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), TABLE_CHECK_S)
            if self._publish_now.is_set():
                published = -1

    def _receive(self, frames: list) -> None:
        identity = frames[0].bytes
        for (kind, header), raw in wire.unpack(frames[1:]):
            self._take(identity, kind, header, raw)

    def _take(self, identity: bytes, kind: bytes, header: Any, raw: list) -> None:
        if kind == wire.TABLE:  # a front end starting: the table to it now, not to everyone
            self._answer(identity, wire.TABLE_CALL, True, (self._process, self.engine.table()))
        elif kind == wire.FAILED:
            self.engine.record_failure(*header)
        elif kind == wire.CANCEL:
            gone = self._gone.get((identity, header))
            if gone is not None and not gone.done():
                gone.set_result(None)
        else:
            if kind == wire.INFER:
                # registered now, not when the task starts: a cancel in the same message finds it
                gone = asyncio.get_running_loop().create_future()
                self._gone[(identity, header[0])] = gone
                call = self._infer(identity, header, raw, gone)
            else:
                call = self._control(identity, header)
            task = asyncio.get_running_loop().create_task(call)
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _answer(self, identity: bytes, call_id: int, ok: bool, payload: Any, *frames: Any) -> None:
        outbox = self._outboxes.get(identity)
        if outbox is None:
            assert self._calls is not None
            outbox = self._outboxes[identity] = wire.Outbox(self._calls.send, prefix=(identity,))
        # the answer to the only call in progress (its own task) has no partner to wait for
        outbox.put((call_id, ok, payload), *frames, at_once=len(self._running) <= 1)

    async def _infer(
        self, identity: bytes, header: tuple, inline: list, gone: asyncio.Future
    ) -> None:
        (call_id, name, version, requested, key, graph, request_id, arena, offset, shape, dtype,
         trace) = header  # fmt: skip
        if arena is None:
            rows = np.frombuffer(inline[0].buffer, dtype=np.dtype(dtype)).reshape(shape)
        else:
            rows = self._reader.rows(arena, offset, shape, dtype)
        try:
            with tracing.attached(trace):
                outputs = await self.engine.infer(
                    name, version, requested, key, graph, rows, request_id, gone
                )
            specs, frames = wire.output_frames(outputs)
            self._answer(identity, call_id, True, specs, *frames)
        except ServiceError as error:
            self._answer(identity, call_id, False, wire.error_payload(error))
        except Exception as error:
            logger.exception("engine call %s [request %s] failed", call_id, request_id)
            failure = InferenceFailed(f"the engine failed on this request ({type(error).__name__})")
            self._answer(identity, call_id, False, wire.error_payload(failure))
        finally:
            del self._gone[(identity, call_id)]

    async def _control(self, identity: bytes, header: tuple) -> None:
        call_id, op, arguments = header
        try:
            result = await self.engine.control(op, **arguments)
        except ServiceError as error:
            self._answer(identity, call_id, False, wire.error_payload(error))
        except Exception as error:
            logger.exception("engine control %s failed", op)
            failure = ServiceError(f"the engine failed on {op} ({type(error).__name__})")
            self._answer(identity, call_id, False, wire.error_payload(failure))
        else:
            self._answer(identity, call_id, True, result)
        self._publish_now.set()  # a load or unload changes the table
