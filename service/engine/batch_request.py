"""One caller's images in the batcher's queue: a queue item per image, and the request they belong to.

The request has one future (not one per image: the event loop's cost of a request does not grow with
its images). It is answered with its :data:`Outputs` once its last image has run, or with the first
error: a failed batch, its deadline passing (:class:`TimedOut`), or its client going away
(:class:`ClientGone`). A batch hands each request its images' rows of every output at once (slices of
the batch's outputs, not one copy per image), so a request that ran in one batch is answered with views
of that batch's outputs. An item whose request is answered need not run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.engine.statistics import BatchTimes
from service.link.protocol import Outputs
from service.observability import tracing


class ClientGone(Exception):
    """The client went away before every image had run."""


class TimedOut(Exception):
    """The request's deadline passed before every image had run."""


class BatchRequest:
    __slots__ = (
        "batches",
        "count",
        "enqueued",
        "future",
        "non_finite",
        "parts",
        "queue_trace",
        "remaining",
        "started",
    )

    def __init__(
        self,
        future: asyncio.Future,
        count: int,
        enqueued: float = 0.0,
        queue_trace: tracing.QueueTrace | None = None,
    ) -> None:
        self.future = future
        self.count = count
        self.remaining = count  # images not run yet
        self.enqueued = enqueued  # event-loop time
        self.queue_trace = queue_trace  # its span in the queue, when tracing
        self.parts: list[tuple[int, Sequence[np.ndarray]]] = []  # (first image, its outputs' rows)
        self.non_finite = 0  # images whose outputs held NaN or Infinity
        # for the statistics: when its last batch started, and what each of its batches took
        self.started = 0.0
        self.batches: list[BatchTimes] = []

    def deliver(
        self,
        first: int,
        outputs: Sequence[np.ndarray],
        started: float = 0.0,
        times: BatchTimes | None = None,
        non_finite: int = 0,
    ) -> None:
        """Some of this request's images, from its image ``first`` on, ran in one batch that
        ``started`` (event-loop time) and took ``times``: ``outputs`` holds their rows of every
        output, in order."""
        if self.future.done():
            return
        self.parts.append((first, outputs))
        self.remaining -= len(outputs[0])
        self.non_finite += non_finite
        self.started = max(self.started, started)
        if times is not None:
            self.batches.append(times)
        if self.remaining == 0:
            self.future.set_result(self._joined())

    def _joined(self) -> Outputs:
        if len(self.parts) == 1:
            return list(self.parts[0][1])
        self.parts.sort(key=lambda part: part[0])
        return [
            np.concatenate(rows) for rows in zip(*(part for _, part in self.parts), strict=True)
        ]

    def fail(self, error: BaseException) -> None:
        """Answer with ``error``, unless already answered."""
        if not self.future.done():
            self.future.set_exception(error)

    async def wait(self, deadline: float, disconnected: Awaitable[object] | None) -> Outputs:
        """Every output, stacked over the images in order, once all have run. Raises
        :class:`TimedOut` at ``deadline`` (event-loop time), :class:`ClientGone` when ``disconnected``
        completes, or the error a batch failed with; a cancelled caller leaves the request answered
        (cancelled)."""
        if self.future.done():  # run before its caller waited (a lone image run inline)
            _let_go(disconnected)
            return self.future.result()
        loop = asyncio.get_running_loop()

        def client_left(_: object) -> None:
            self.fail(ClientGone())

        watch = asyncio.ensure_future(disconnected) if disconnected is not None else None
        if watch is not None:
            watch.add_done_callback(client_left)
        timer = loop.call_at(deadline, self.time_out)
        try:
            return await self.future
        finally:
            timer.cancel()
            if watch is not None:
                watch.remove_done_callback(client_left)
                watch.cancel()
            if not self.future.done():
                self.future.cancel()  # the caller itself was cancelled

    def time_out(self) -> None:
        """Its deadline has passed."""
        self.fail(TimedOut())


def _let_go(signal: Awaitable[object] | None) -> None:
    """The client-gone signal of a request answered before it waited: nobody watches it any more."""
    if isinstance(signal, asyncio.Future):
        signal.cancel()
    elif asyncio.iscoroutine(signal):
        signal.close()


@dataclass(eq=False)
class QueueItem:
    """One image in the queue."""

    row: np.ndarray
    request: BatchRequest
    index: int  # its place among its request's images
    request_id: str | None = field(default=None)

    @property
    def abandoned(self) -> bool:
        """Its request was answered (a failure, a timeout, a client gone): it need not run."""
        return self.request.future.done()
