"""The engine process's end of the link: a Unix socket every front end connects to.

The calls that arrive in one turn of the engine's event loop, from every front end, are queued together
in the next, so the batcher fills its batches from all of them. A call that came alone, with nothing
else in progress, may run there and then and be answered at once (a lone image of a fast model: no
task, no wait); every other call waits for its answer in a task of its own. The answers a batch
completes go back to each front end in one message. Each front end gets the table when it connects,
whenever it changes (looked at every ``TABLE_CHECK_S``) and at least every ``HEARTBEAT_S``. A front end
whose connection ends (it died) has its calls cancelled: their rows still queued never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from service.engine.core import Engine
from service.engine.pipeline import Call
from service.engine.table import Outputs
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
        self._server: asyncio.AbstractServer | None = None
        self._links: set[wire.Link] = set()  # one per front end connected
        self._reader = ArenaReader()
        self._arenas: dict[wire.Link, set[str]] = {}  # the shared-memory blocks each front end used
        self._gone: dict[tuple[wire.Link, int], asyncio.Future] = {}  # a call's client-gone signal
        self._arrived: list[tuple[wire.Link, tuple, list, asyncio.Future]] = []  # calls to start
        self._running: set[asyncio.Task] = set()
        self._publish_now = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # sent with every table: a restarted engine that got its predecessor's pid is still new
        self._process = (os.getpid(), time.time_ns())

    async def bind(self) -> None:
        path = self.addresses.engine
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the socket of an engine that died
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: wire.Link(self._take, self._lost), path
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

    async def _publish(self) -> None:
        published, last = -1, 0.0
        loop = asyncio.get_running_loop()
        while True:
            table = self.engine.table()
            now = loop.time()
            if table.generation != published or now - last >= HEARTBEAT_S:
                for link in self._links:
                    link.outbox.put((wire.TABLE_CALL, True, (self._process, table)))
                published, last = table.generation, now
            self._publish_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), TABLE_CHECK_S)
            if self._publish_now.is_set():
                published = -1

    def _lost(self, link: wire.Link) -> None:
        """A front end went away: nobody will read its answers, so its calls need not run, and its
        shared memory is let go (a block still holding queued rows goes with them)."""
        self._links.discard(link)
        for name in self._arenas.pop(link, ()):
            self._reader.forget(name)
        for (owner, _), gone in list(self._gone.items()):
            if owner is link and not gone.done():
                gone.set_result(None)

    def _take(self, link: wire.Link, item: tuple[bytes, Any], raw: list) -> None:
        kind, header = item
        if kind == wire.TABLE:  # a front end connecting: the table to it now, and from now on
            self._links.add(link)
            link.outbox.put((wire.TABLE_CALL, True, (self._process, self.engine.table())))
        elif kind == wire.FAILED:
            self.engine.record_failure(*header)
        elif kind == wire.CANCEL:
            gone = self._gone.get((link, header))
            if gone is not None and not gone.done():
                gone.set_result(None)
        elif kind == wire.INFER:
            # its client-gone signal registered now: a cancel in the same message finds it
            loop = asyncio.get_running_loop()
            gone = self._gone[(link, header[0])] = loop.create_future()
            self._arrived.append((link, header, raw, gone))
            if len(self._arrived) == 1:
                loop.call_soon(self._start_arrived)
        else:
            self._track(self._control(link, header))

    def _track(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _answer(self, link: wire.Link, call_id: int, ok: bool, payload: Any, *frames: Any) -> None:
        # the answer to the only call in progress has no partner to wait for
        link.outbox.put((call_id, ok, payload), *frames, at_once=len(self._running) <= 1)

    def _answer_outputs(self, link: wire.Link, call_id: int, outputs: Outputs) -> None:
        specs, frames = wire.output_frames(outputs)
        self._answer(link, call_id, True, specs, *frames)

    def _answer_error(
        self, link: wire.Link, call_id: int, request_id: str | None, error: Exception
    ) -> None:
        if not isinstance(error, ServiceError):
            logger.error("engine call %s [request %s] failed", call_id, request_id, exc_info=error)
            error = InferenceFailed(f"the engine failed on this request ({type(error).__name__})")
        self._answer(link, call_id, False, wire.error_payload(error))

    def _start_arrived(self) -> None:
        """Queue the calls that arrived in the last turn of the loop; one that came alone, with
        nothing else in progress, runs at once on an idle model (``Engine.call``)."""
        arrived, self._arrived = self._arrived, []
        alone = len(arrived) == 1 and not self._running
        for link, header, raw, gone in arrived:
            self._start(link, header, raw, gone, alone)

    def _start(
        self, link: wire.Link, header: tuple, inline: list, gone: asyncio.Future, alone: bool
    ) -> None:
        (call_id, name, version, requested, key, graph, request_id, arena, offset, shape, dtype,
         trace) = header  # fmt: skip
        try:
            if arena is None:
                rows = np.frombuffer(inline[0], dtype=np.dtype(dtype)).reshape(shape)
            else:
                rows = self._reader.rows(arena, offset, shape, dtype)
                self._arenas.setdefault(link, set()).add(arena)
            with tracing.attached(trace):
                call = self.engine.call(
                    name, version, requested, key, graph, rows, request_id, alone
                )
            if not call.answered:  # its answer comes when its batch has run
                self._track(self._wait(link, call_id, request_id, call, gone))
                return
            self._answer_outputs(link, call_id, call.outputs())
        except Exception as error:
            self._answer_error(link, call_id, request_id, error)
        del self._gone[(link, call_id)]

    async def _wait(
        self,
        link: wire.Link,
        call_id: int,
        request_id: str | None,
        call: Call,
        gone: asyncio.Future,
    ) -> None:
        try:
            self._answer_outputs(link, call_id, await call.wait(gone))
        except Exception as error:
            self._answer_error(link, call_id, request_id, error)
        finally:
            del self._gone[(link, call_id)]

    async def _control(self, link: wire.Link, header: tuple) -> None:
        call_id, op, arguments = header
        try:
            result = await self.engine.control(op, **arguments)
        except ServiceError as error:
            self._answer(link, call_id, False, wire.error_payload(error))
        except Exception as error:
            logger.exception("engine control %s failed", op)
            failure = ServiceError(f"the engine failed on {op} ({type(error).__name__})")
            self._answer(link, call_id, False, wire.error_payload(failure))
        else:
            self._answer(link, call_id, True, result)
        self._publish_now.set()  # a load or unload changes the table
