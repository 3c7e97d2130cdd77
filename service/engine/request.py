"""One request in the engine, from its rows being queued to its answer: the engine's one request object.

A request holds a caller's rows (one image each), how many of them a batch has taken and how many have
run, and what its batches took. It ends once, with its :data:`Outputs` after its last image has run or
with the first error (a failed batch, its deadline passing: :class:`TimedOut`, its client going away:
:class:`ClientGone`), and every end goes the same way: to its owner (the batcher that queued it, which
settles the queue, records the statistics and translates the error), which hands the outputs or the
error to the request's ``reply``. Inline run, batched run, refusal or cancel alike: one path, no task
and no future per request. A batch hands a request its images' rows of every output at once (slices of
the batch's outputs), so a request that ran in one batch is answered with views of them.

:func:`awaited` is the way to wait for a request instead (a front end's own engine, the tests).
:class:`Lease`: what a model version's requests hold on it while they are queued or running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from service.contract.table import Outputs, ShadowCopy
from service.engine.statistics import BatchTimes
from service.observability import tracing

Reply = Callable[["Request", Outputs | None, Exception | None], None]


class ClientGone(Exception):
    """The client went away before every image had run."""


class TimedOut(Exception):
    """The request's deadline passed before every image had run."""


class Owner(Protocol):
    def ended(self, request: Request, outputs: Outputs | None, error: Exception | None) -> None:
        """``request`` has ended (once): settle it and hand its reply the outcome."""


class Request:
    __slots__ = (
        "batches",
        "count",
        "deadline",
        "done",
        "enqueued",
        "entered",
        "non_finite",
        "owner",
        "parts",
        "queue_trace",
        "remaining",
        "reply",
        "request_id",
        "rows",
        "shadow",
        "started",
        "tag",
        "taken",
    )

    def __init__(
        self, rows: np.ndarray, reply: Reply, request_id: str | None = None, tag: Any = None
    ) -> None:
        self.rows: np.ndarray | None = rows
        self.reply = reply  # hands the outcome on (to a front end's outbox, a future, ...)
        self.request_id = request_id
        self.tag = tag  # the reply's own data: which call of which front end
        self.shadow: ShadowCopy | None = None  # its copy for the model's candidate, when drawn
        self.count = len(rows)
        self.taken = 0  # images a batch has taken from the queue
        self.remaining = self.count  # images not run yet
        self.done = False
        self.owner: Owner | None = None  # the batcher that queued it
        self.entered = time.perf_counter_ns()  # for the statistics' request duration
        self.enqueued = 0.0  # event-loop time, set as it is queued
        self.deadline = float("inf")  # event-loop time
        self.queue_trace: tracing.QueueTrace | None = None  # its span in the queue, when tracing
        self.parts: list[tuple[int, list[np.ndarray]]] = []  # (first image, its outputs' rows)
        self.non_finite = 0  # images whose outputs held NaN or Infinity
        # for the statistics: when its last batch started, and what each of its batches took
        self.started = 0.0
        self.batches: list[BatchTimes] = []

    def deliver(
        self,
        first: int,
        outputs: list[np.ndarray],
        started: float = 0.0,
        times: BatchTimes | None = None,
        non_finite: int = 0,
    ) -> None:
        """Some of its images, from image ``first`` on, ran in one batch that ``started`` (event-loop
        time) and took ``times``: ``outputs`` holds their rows of every output, in order."""
        if self.done:
            return
        self.remaining -= len(outputs[0])
        self.non_finite += non_finite
        if started > self.started:
            self.started = started
        if times is not None:
            self.batches.append(times)
        if self.remaining == 0 and not self.parts:  # every image in this one batch
            self._end(outputs, None)
            return
        self.parts.append((first, outputs))
        if self.remaining == 0:
            self._end(self._joined(), None)

    def _joined(self) -> Outputs:
        """The outputs of a request whose images ran in several batches, in image order."""
        self.parts.sort(key=lambda part: part[0])
        return [
            np.concatenate(rows) for rows in zip(*(part for _, part in self.parts), strict=True)
        ]

    def fail(self, error: Exception) -> None:
        """End with ``error``, unless it has ended."""
        if not self.done:
            self._end(None, error)

    def cancel(self) -> None:
        """Its client has gone: the images still queued never run, and it ends as a 499."""
        self.fail(ClientGone())

    def time_out(self) -> None:
        """Its deadline has passed."""
        self.fail(TimedOut())

    def _end(self, outputs: Outputs | None, error: Exception | None) -> None:
        self.done = True
        self.rows = None  # a front end's shared memory is unmapped once no rows of it are held
        if self.owner is not None:
            self.owner.ended(self, outputs, error)
        else:  # never queued
            self.reply(self, outputs, error)


class Lease:
    """A model version's: held by each request its batchers queue, from then to its end (and by a
    shadow batch running on it); a version being retired waits for every hold to be given back."""

    def __init__(self) -> None:
        self.held = 0
        self._drained = asyncio.Event()
        self._drained.set()

    def hold(self, requests: int = 1) -> None:
        """Each of ``requests`` gives its hold back once, by :meth:`release`."""
        self.held += requests
        self._drained.clear()

    def release(self) -> None:
        self.held -= 1
        if self.held == 0:
            self._drained.set()

    async def drained(self) -> None:
        await self._drained.wait()


async def awaited(
    start: Callable[[Request], None],
    rows: np.ndarray,
    request_id: str | None = None,
    disconnected: Awaitable[object] | None = None,
    shadow: ShadowCopy | None = None,
) -> Outputs:
    """Make a request of ``rows``, ``start`` it (queue it: it may end before ``start`` returns) and
    wait for its outputs, or raise its error. ``disconnected`` completes when the client has gone:
    the request is then cancelled; so it is when the caller itself is cancelled."""
    future = asyncio.get_running_loop().create_future()

    def reply(_: Request, outputs: Outputs | None, error: Exception | None) -> None:
        if not future.done():
            future.set_result(outputs) if error is None else future.set_exception(error)

    request = Request(rows, reply, request_id)
    request.shadow = shadow
    start(request)
    if future.done():  # run before its caller waited (a lone image run inline, or refused)
        _let_go(disconnected)
        return future.result()
    watch = asyncio.ensure_future(disconnected) if disconnected is not None else None
    if watch is not None:
        watch.add_done_callback(lambda _: request.cancel())
    try:
        return await future
    finally:
        if watch is not None:
            watch.cancel()
        request.cancel()  # the caller itself was cancelled (a no-op once it has ended)


def _let_go(signal: Awaitable[object] | None) -> None:
    """The client-gone signal of a request answered before it waited: nobody watches it any more."""
    if isinstance(signal, asyncio.Future):
        signal.cancel()
    elif asyncio.iscoroutine(signal):
        signal.close()
