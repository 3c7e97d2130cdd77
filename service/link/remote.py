"""A front end's link to the engine process: calls, answers and tables over one Unix socket.

The rows of a call go into the front end's shared-memory arena (or inline when they do not fit) and only
their place travels; the answer's outputs come back as raw frames. A client that goes away sends a cancel,
so its rows still queued never run. Every call has a deadline here too (the version's request timeout,
and ``DEADLINE_GRACE_S`` for the engine's own 503 to arrive first): past it, a call the engine never
answered (a lost message, a stalled engine) is answered 503 and its arena region freed, so neither the
call nor its rows are held for ever. The engine's pid comes with every table: the front end watches it
(``pidfd``), so when the engine dies the front end is not ready at once, and every call it had in flight is
answered 503 with Retry-After. The front end connects again every ``RECONNECT_S`` until a restarted engine
listens; its first table makes the front end ready again. A request that arrives meanwhile waits until the
new engine has started (loaded its models), ``ENGINE_WAIT_S`` at most: a restart is a pause to its clients
rather than a burst of 503s, and a request that reaches this front end just after another front end said
"ready" finds the engine too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np

from service.contract.control import ControlOp
from service.contract.table import Call, Graph, ModelTable, Outputs, VersionView
from service.errors import InvalidInput, ServiceUnavailable
from service.link import wire
from service.link.arena import Arena, Region
from service.link.client import EngineClient
from service.link.protocol import Answer, Cancel, Failed, Hello, Infer, Remote, Result, TableUpdate
from service.observability import tracing
from service.observability.metrics import Metrics

logger = logging.getLogger("vitserve")

# how long stop() waits for the answers of calls still in flight (gRPC calls finishing their grace)
STOP_WAIT_S = 5.0
# after the engine answers "queue full" for a graph, requests for it are refused before decoding for
# this long (the engine's queue is not seen from here: its last answer stands in for it)
FULL_MEMORY_S = 0.05
# how long a started engine's table is waited for: at start before connections are accepted, and by a
# request that arrives while the engine restarts (1-3 s with the shipped model)
ENGINE_WAIT_S = 2.0
# an engine whose table (published at least every 0.5 s) has not come for this long is taken for dead,
# where its pid cannot be watched
SILENT_ENGINE_S = 3.0
RECONNECT_S = 0.05
# a call's deadline: its version's request timeout (the engine answers 503 at it), and this for that
# answer to arrive; a version with none, and a control call, wait at most CALL_DEADLINE_S
DEADLINE_GRACE_S = 1.0
CALL_DEADLINE_S = 600.0


class RemoteEngine(EngineClient):
    def __init__(
        self,
        addresses: wire.Addresses,
        arena_name: str,
        arena_bytes: int,
        retry_after_s: int,
        metrics: Metrics,
    ) -> None:
        self.addresses = addresses
        self.metrics = metrics
        self._arena_name = arena_name
        self._arena_bytes = arena_bytes
        self._retry_after_s = retry_after_s
        self._table = ModelTable(phase="starting", retry_after_s=retry_after_s)
        self._engine: tuple[int, int] | None = None  # the engine process followed: pid, start
        self._pidfd: int | None = None
        self._dead_engines: set[tuple[int, int]] = set()  # one per engine restart
        self._ids = itertools.count(1)
        # a call's answer, its rows' region, what a queue-full answer would mark full, its deadline
        self._pending: dict[
            int, tuple[asyncio.Future, Region | None, tuple | None, asyncio.TimerHandle]
        ] = {}
        self._tasks: list[asyncio.Task] = []
        self._link: wire.Link | None = None  # the connection to the engine, while there is one
        # set while the table held is a running engine's past its start-up (its first load)
        self._engine_started = asyncio.Event()
        self._last_table = time.monotonic()
        self._full: dict[tuple[str, int, str], tuple[float, ServiceUnavailable]] = {}
        self.arena: Arena | None = None

    @property
    def table(self) -> ModelTable:
        return self._table

    @property
    def connected(self) -> bool:
        return self._engine is not None

    @property
    def engine_pid(self) -> int | None:
        """The engine process whose tables this front end follows (None: none now)."""
        return None if self._engine is None else self._engine[0]

    # --- life -------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.arena = Arena(self._arena_name, self._arena_bytes)
        except OSError as error:  # rows then travel inside the messages: slower, never wrong
            logger.warning(
                "no shared memory for the rows (%d MiB in /dev/shm: %s); they go inside the "
                "messages to the engine (lower VITSERVE_ARENA_MIB, or give /dev/shm more room)",
                self._arena_bytes // 2**20,
                error.strerror or error,
            )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_heartbeat(), name="engine-heartbeat"),
            loop.create_task(self._stay_connected(), name="engine-link"),
        ]
        # accept connections knowing the engine's state (a started engine answers at once; one that
        # is starting within ENGINE_WAIT_S, and past it this front end's requests wait for it)
        await self.table_to_route_by()

    def begin_shutdown(self) -> None:
        """Nothing to do here: the supervisor tells the engine."""

    async def stop(self) -> None:
        if self._pending:  # calls still in flight (gRPC calls within their grace): wait a little
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_WAIT_S):
                    await asyncio.gather(
                        *(entry[0] for entry in self._pending.values()), return_exceptions=True
                    )
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._engine_gone("the front end is stopping")
        self._unwatch()
        if self._link is not None:
            self._link.close()
        if self.arena is not None:
            self.arena.close()

    # --- the engine's tables and its life -----------------------------------------------------------

    async def _stay_connected(self) -> None:
        """Connected to the engine whenever it listens: at start, and again after each restart."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                with wire.socket_path(self.addresses.engine) as address:
                    _, link = await loop.create_unix_connection(
                        lambda: wire.Link(
                            wire.to_front_end, self._take, unsendable=self._unsendable
                        ),
                        address,
                    )
            except OSError:  # not listening (yet, or again)
                await asyncio.sleep(RECONNECT_S)
                continue
            self._link = link
            link.outbox.put(Hello(None if self.arena is None else self.arena.name), at_once=True)
            await link.closed
            self._link = None
            self._engine_gone("the link to the engine process was lost")

    async def _watch_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(SILENT_ENGINE_S / 3)
            silent = time.monotonic() - self._last_table
            if self._engine is not None and silent > SILENT_ENGINE_S:
                logger.error("no word from the engine process for %.1f s", silent)
                self._unwatch()
                self._engine_gone("the engine process stopped answering")

    def _take_table(self, engine: tuple[int, int], table: ModelTable) -> None:
        """A table from the engine process ``engine`` (its pid and start time)."""
        if engine in self._dead_engines:  # sent before it died, read after: it would say "ready"
            return
        if engine != self._engine and not self._watch(engine):
            return
        self._last_table = time.monotonic()
        self._table = table
        if table.phase == "starting":
            self._engine_started.clear()
        else:
            self._engine_started.set()

    def _watch(self, engine: tuple[int, int]) -> bool:
        """Follow the engine process: its death is seen at once. False if it is gone already."""
        try:
            pidfd = os.pidfd_open(engine[0])
        except ProcessLookupError:
            self._dead_engines.add(engine)
            return False
        except (OSError, AttributeError):  # no pidfd here: the heartbeat still tells
            pidfd = None
        self._unwatch()
        self._pidfd, self._engine = pidfd, engine
        if pidfd is not None:
            asyncio.get_running_loop().add_reader(pidfd, self._engine_died, engine)
        return True

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _engine_died(self, engine: tuple[int, int]) -> None:
        logger.error(
            "the engine process (pid %d) stopped; waiting for it to be restarted", engine[0]
        )
        self._dead_engines.add(engine)
        self._unwatch()
        self._engine_gone("the engine process stopped before this request was answered")

    def _engine_gone(self, why: str) -> None:
        self._engine = None
        self._engine_started.clear()
        self._table = ModelTable(phase="starting", retry_after_s=self._retry_after_s)
        pending, self._pending = self._pending, {}
        for future, _, _, deadline in pending.values():
            deadline.cancel()
            if not future.done():
                future.set_exception(self._unavailable(why))
        if self.arena is not None:
            self.arena.reset()

    def _unavailable(self, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"{why}; retry after {self._retry_after_s} s",
            code="engine_unavailable",
            retry_after_s=self._retry_after_s,
        )

    async def table_to_route_by(self) -> ModelTable:
        """The latest table; while no engine runs or it is starting, the first of a started
        engine, ``ENGINE_WAIT_S`` at most (then the latest, which answers 503 not_ready)."""
        if not self._engine_started.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ENGINE_WAIT_S):
                    await self._engine_started.wait()
        return self._table

    # --- calls --------------------------------------------------------------------------------------

    def _take(self, link: wire.Link, items: list[wire.Item]) -> None:
        """The items of one message from the engine, in order."""
        for message, raw in items:
            if type(message) is TableUpdate:
                self._take_table((message.pid, message.started), message.table)
                continue
            entry = self._pending.pop(message.call, None)
            if entry is None:
                continue  # answered already (past its deadline, or the engine restarted meanwhile)
            future, region, full_key, deadline = entry
            deadline.cancel()
            if region is not None and self.arena is not None:
                self.arena.free(region)
            if future.done():
                continue
            if type(message) is Answer:
                future.set_result(wire.answer_outputs(message, raw))
            elif type(message) is Result:
                future.set_result(message.value)
            else:
                error = message.error.error()
                if error.code == "queue_full" and full_key is not None:
                    self._full[full_key] = (time.monotonic() + FULL_MEMORY_S, error)
                future.set_exception(error)

    def admit(self, view: VersionView, requested: int | None, graph: Graph, count: int) -> None:
        if not self.connected:
            raise self._unavailable("the engine process is not running")
        full = self._full.get((view.name, view.version, graph))
        if full is not None:
            if time.monotonic() < full[0]:
                self.metrics.rejections.labels(view.name, graph, "queue_full").inc()
                raise full[1]
            del self._full[(view.name, view.version, graph)]

    async def _call(
        self,
        message: Infer | Remote,
        raw: tuple,
        region: Region | None,
        deadline_s: float,
        disconnected: Awaitable[object] | None = None,
        full_key: tuple[str, int, str] | None = None,
    ) -> Any:
        """Send ``message`` and wait for its answer, at most ``deadline_s``."""
        link = self._link
        if not self.connected or link is None or not link.open:
            if region is not None and self.arena is not None:
                self.arena.free(region)
            raise self._unavailable("the engine process is not running")
        call_id = message.call
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        deadline = loop.call_later(deadline_s, self._expire, call_id, deadline_s)
        self._pending[call_id] = (future, region, full_key, deadline)
        link.outbox.put(message, *raw, at_once=len(self._pending) == 1)
        watch = asyncio.ensure_future(disconnected) if disconnected is not None else None
        if watch is not None:
            watch.add_done_callback(lambda _: self._cancel(call_id))
        try:
            return await future
        finally:
            if watch is not None:
                watch.cancel()
            if not future.done():  # the caller itself was cancelled
                self._cancel(call_id)

    def _unsendable(self, message: Any, error: Exception) -> wire.Item | None:
        """A call whose message cannot be encoded (a number beyond msgpack's 64 bits) is answered
        here with the error, on its own: the other calls of its message still go."""
        if type(message) not in (Infer, Remote):
            return None
        entry = self._pending.pop(message.call, None)
        if entry is None:
            return None
        future, region, _, deadline = entry
        deadline.cancel()
        if region is not None and self.arena is not None:
            self.arena.free(region)
        if not future.done():
            future.set_exception(
                InvalidInput(
                    f"the call cannot be sent to the engine ({type(error).__name__}: {error})",
                    code="unsendable_call",
                )
            )
        return None

    def _cancel(self, call_id: int) -> None:
        if call_id in self._pending and self._link is not None:
            self._link.outbox.put(Cancel(call_id))

    def _expire(self, call_id: int, deadline_s: float) -> None:
        """A call the engine has not answered by its deadline: answered 503 here and forgotten (its
        rows' region freed, the engine told to drop it); a late answer finds nothing."""
        entry = self._pending.get(call_id)
        if entry is None:
            return
        self._cancel(call_id)
        del self._pending[call_id]
        future, region, _, _ = entry
        if region is not None and self.arena is not None:
            self.arena.free(region)
        if not future.done():
            future.set_exception(
                ServiceUnavailable(
                    f"the engine did not answer within {deadline_s:g} s; retry after "
                    f"{self._retry_after_s} s",
                    code="engine_timeout",
                    retry_after_s=self._retry_after_s,
                )
            )

    async def infer(self, call: Call) -> Outputs:
        view, graph, shadow = call.view, call.graph, call.shadow
        rows = np.ascontiguousarray(call.rows)
        shape, mark = rows.shape, None if shadow is None else shadow.mark
        own = None if shadow is None else shadow.rows
        if own is not None:  # the candidate's rows travel right after the call's, in one buffer
            rows = np.concatenate((rows.reshape(-1), own.reshape(-1)))
        region = self.arena.put(rows) if self.arena is not None else None
        message = Infer(
            next(self._ids),
            view.name,
            view.version,
            call.requested,
            view.preprocessing_key,
            graph,
            shape,
            rows.dtype.str,
            None if region is None else region.offset,
            call.request_id,
            tracing.carrier(),
            mark,
            None if own is None else own.shape,
        )
        raw = (rows.data,) if region is None else ()
        timeout = view.serving.request_timeout_s
        deadline_s = CALL_DEADLINE_S if timeout is None else timeout + DEADLINE_GRACE_S
        full_key = (view.name, view.version, graph)
        return await self._call(message, raw, region, deadline_s, call.disconnected, full_key)

    def record_failure(self, view: VersionView, ns: int) -> None:
        if self.connected and self._link is not None:
            self._link.outbox.put(Failed(view.name, view.version, ns))

    async def control(
        self, op: ControlOp, name: str | None = None, version: int | None = None
    ) -> Any:
        message = Remote(next(self._ids), op, name, version)
        value = await self._call(message, (), None, CALL_DEADLINE_S)
        return wire.result_value(op, value)
