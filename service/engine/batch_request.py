"""One caller's images in the batcher's queue: a queue item per image, and the request they belong to.

The request has one future (not one per image: the event loop's cost of a request does not grow with
its images). It is answered with every image's outputs when the last has run, or with the first error:
a failed batch, its deadline passing (:class:`TimedOut`), or its client going away
(:class:`ClientGone`). An item whose request is answered need not run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field

import numpy as np

from service.engine.statistics import BatchTimes
from service.observability import tracing

Row = tuple[np.ndarray, ...]  # one image's outputs


class ClientGone(Exception):
    """The client went away before every image had run."""


class TimedOut(Exception):
    """The request's deadline passed before every image had run."""


class BatchRequest:
    __slots__ = ("future", "remaining", "rows")

    def __init__(self, future: asyncio.Future, count: int) -> None:
        self.future = future
        self.rows: list[Row | None] = [None] * count
        self.remaining = count  # images not run yet

    def deliver(self, index: int, row: Row) -> None:
        if self.future.done():
            return
        self.rows[index] = row
        self.remaining -= 1
        if self.remaining == 0:
            self.future.set_result(self.rows)

    def fail(self, error: BaseException) -> None:
        """Answer with ``error``, unless already answered."""
        if not self.future.done():
            self.future.set_exception(error)

    async def wait(self, deadline: float, disconnected: Awaitable[object] | None) -> list[Row]:
        """Every image's outputs, in order, once all have run. Raises :class:`TimedOut` at
        ``deadline`` (event-loop time), :class:`ClientGone` when ``disconnected`` completes, or the
        error a batch failed with; a cancelled caller leaves the request answered (cancelled)."""
        loop = asyncio.get_running_loop()

        def client_left(_: object) -> None:
            self.fail(ClientGone())

        watch = asyncio.ensure_future(disconnected) if disconnected is not None else None
        if watch is not None:
            watch.add_done_callback(client_left)
        timer = loop.call_at(deadline, self._time_out)
        try:
            return await self.future
        finally:
            timer.cancel()
            if watch is not None:
                watch.remove_done_callback(client_left)
                watch.cancel()
            if not self.future.done():
                self.future.cancel()  # the caller itself was cancelled

    def _time_out(self) -> None:
        self.fail(TimedOut())


@dataclass(eq=False)
class QueueItem:
    """One image in the queue."""

    row: np.ndarray
    request: BatchRequest
    index: int  # its place among its request's images
    enqueued: float
    request_id: str | None = field(default=None)
    # statistics and tracing: when its batch started, what the batch took, the request's queue span
    started: float = 0.0
    batch: BatchTimes | None = None
    finite: bool = True  # every number of its outputs (output_checks.finite_rows)
    wait: tracing.QueueTrace | None = None

    @property
    def abandoned(self) -> bool:
        """Its request was answered (a failure, a timeout, a client gone): it need not run."""
        return self.request.future.done()
