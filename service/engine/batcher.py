"""A dynamic batcher in the manner of Triton's: bounded queue, max batch size, max queue delay, preferred
batch sizes, and several model instances running batches at once (``service/engine/batch_runs.py``).

The queue holds :class:`~service.engine.request.Request` objects in arrival order; a request holding
several images may be split across batches. The requests one caller had ready at once (the calls of one
message from a front end) are queued together by :meth:`DynamicBatcher.enqueue`, with one look at what
is due. When every instance is idle, what is queued runs at once instead of waiting for partners that may
not come (the requests that arrive in one turn of the event loop still run together, and what queued
while a batch ran runs as soon as it ends), unless ``idle_dispatch`` is off. Otherwise a batch runs when
the largest preferred size is waiting (else the max batch size), or when its oldest image has waited
``max_queue_delay`` (then at the largest preferred size that is waiting, else all that fit), and an
instance is idle. What is due is looked at once a turn of the event loop after requests were queued,
and by each instance as it finishes a batch; the batching loop itself is woken only when it has to wait
out a queue delay with an instance idle, or to end a drain, so under load it sleeps.

Admission is all-or-nothing and immediate: when a request's images do not fit in the queue it is
answered 503 with ``Retry-After`` without waiting. A request not finished within its timeout gets 503
(one timer for the batcher, not one per request); one whose client went away is cancelled and its
images never run. Every request ends in :meth:`DynamicBatcher.ended`: its queue places freed, its
statistics recorded, its error translated into the service's, its lease given back, its reply called.
``close()`` makes the queue run without waiting for the delay (shutdown); ``stop()`` drains it and says
how many images it had to fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from service.contract.table import Outputs
from service.engine.batch_runs import Instances, RunBatch, Segment, require_finite
from service.engine.request import ClientGone, Lease, Request, TimedOut
from service.engine.statistics import ModelStatistics
from service.errors import ClientDisconnected, InvalidInput, ServiceError, ServiceUnavailable
from service.observability import tracing
from service.observability.metrics import Metrics

logger = logging.getLogger("vitserve")


class DynamicBatcher:
    def __init__(
        self,
        graph: str,
        run: RunBatch | Sequence[RunBatch],
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int | None,
        timeout_s: float | None,
        retry_after_s: int,
        metrics: Metrics,
        model: str = "",
        preferred_batch_sizes: Sequence[int] = (),
        statistics: ModelStatistics | None = None,
        idle_dispatch: bool = True,
        lease: Lease | None = None,
        version: int | None = None,
        row_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.graph = graph
        self.model = model
        self.version = version
        self.row_shape = row_shape  # one image's float32 row, as its version takes it (None: any)
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.idle_dispatch = idle_dispatch
        self.max_queue_size = max_queue_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.preferred_batch_sizes = sorted(
            {size for size in preferred_batch_sizes if 1 <= size <= max_batch_size}
        )
        self._metrics = metrics
        self.statistics = statistics if statistics is not None else ModelStatistics()
        self._lease = lease
        self._labels = (model, graph)
        self._depth = metrics.queue_depth.labels(*self._labels)
        self._depth_shown = 0  # what the gauge holds: written only when the depth changed
        runs = [run] if callable(run) else list(run)
        self._instances = Instances(graph, model, runs, metrics, self.statistics, self._freed)
        self._queue: deque[Request] = deque()  # arrival order; ended ones are skipped
        self._queued = 0  # images waiting in the queue, of requests that have not ended
        self._deadlines: deque[Request] = deque()  # arrival order: deadlines ascend
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._wakeup = asyncio.Event()  # the batching loop has something to wait for
        self._dispatch_due = False  # a look at what is due is scheduled for the loop's next turn
        self._closing = False
        self._flushing = False
        self._task: asyncio.Task | None = None
        self.failure: BaseException | None = None

    @property
    def healthy(self) -> bool:
        """False once the batching loop has died; readiness reports it."""
        return self._task is not None and self.failure is None

    @property
    def accepting(self) -> bool:
        """Takes new work: started, not failed, not closing."""
        return self.healthy and not self._closing

    @property
    def queued(self) -> int:
        """Images waiting for a batch."""
        return self._queued

    @property
    def spare(self) -> bool:
        """Nothing waits and an instance is idle: work of lower priority may run now."""
        return not self._queued and bool(self._instances.idle)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"batcher-{self.model}-{self.graph}"
        )
        self._task.add_done_callback(self._watch)

    def _watch(self, task: asyncio.Task) -> None:
        """The watchdog: a loop that dies fails what it held, at once, instead of letting every
        caller wait for its timeout."""
        if task.cancelled() or task.exception() is None:
            return
        self._died(task.exception())  # type: ignore[arg-type]

    def _died(self, failure: BaseException) -> None:
        """The batching loop, or a look at what is due on its behalf, failed: fail what it held."""
        self.failure = failure
        logger.error(
            "the %s batcher of %s stopped: %r", self.graph, self.model or "-", self.failure
        )
        self.fail_all("the batcher stopped; retry on another instance", "batcher_failed")

    # --- admission and queueing -----------------------------------------------------------------------

    def admit(self, count: int) -> None:
        """Raise the 503 that :meth:`enqueue` would answer for ``count`` images now.

        Callers check before decoding, so that an overloaded service refuses at once instead of
        decoding images it cannot queue; ``enqueue`` checks again, as the queue moves meanwhile.
        """
        if self._task is None or self.failure is not None:
            raise ServiceUnavailable(
                f"the {self.graph} batcher is not running; retry shortly",
                code="not_ready",
                retry_after_s=self.retry_after_s,
            )
        if self._closing:
            self._reject("shutting_down")
            raise ServiceUnavailable(
                "this model version is shutting down and accepts no new work; retry",
                code="shutting_down",
                retry_after_s=self.retry_after_s,
            )
        if self.max_queue_size is not None and self._queued + count > self.max_queue_size:
            self._reject("queue_full")
            raise ServiceUnavailable(
                f"the {self.graph} queue is full: {self._queued} images waiting, this request adds "
                f"{count}, the limit is max_queue_size={self.max_queue_size}; retry after "
                f"{self.retry_after_s} s",
                code="queue_full",
                retry_after_s=self.retry_after_s,
            )

    def enqueue(self, requests: list[Request], alone: bool = False) -> None:
        """Queue ``requests`` together, each admitted on its own (one refused is answered its 503
        at once, and one whose rows are not float32 images of ``row_shape`` its 422: one bad call
        must not fail the batch it would join); then start what is due. ``alone``: the caller knows no other request will join
        these in this turn of the event loop, so with every instance idle their images start here
        and now, not in the batching loop's next turn; a lone image run inline is answered before
        this returns."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + self.timeout_s if self.timeout_s is not None else float("inf")
        deadlines = self._deadlines
        while deadlines and deadlines[0].done:
            deadlines.popleft()
        timed = self.timeout_s is not None
        queue = self._queue
        queued = 0
        shape = self.row_shape
        for request in requests:
            count = request.count
            rows = request.rows
            if shape is not None and not (
                rows.dtype == np.float32 and rows.shape[1:] == shape and count  # type: ignore[union-attr]
            ):
                self.refuse(request, self._bad_rows(rows))  # type: ignore[arg-type]
                continue
            try:
                self.admit(count)
            except ServiceError as error:
                self.refuse(request, error)
                continue
            request.owner = self
            request.queue_trace = tracing.enter_queue(count)
            request.enqueued = now
            request.deadline = deadline
            queue.append(request)
            self._queued += count
            if timed:
                deadlines.append(request)
            queued += 1
        if not queued:
            return
        if self._lease is not None:
            self._lease.hold(queued)
        if self.timeout_s is not None and self._deadline_timer is None:
            self._deadline_timer = loop.call_at(deadlines[0].deadline, self._expire)
        if alone and self._idle_due():
            self._dispatch(loop)
            self._wake_if_waiting()
        else:  # what else arrives this turn may join them
            self._show_depth()
            if not self._dispatch_due:
                self._dispatch_due = True
                loop.call_soon(self._dispatch_later)

    def _bad_rows(self, rows: np.ndarray) -> InvalidInput:
        return InvalidInput(
            f"rows of {rows.dtype} {list(rows.shape)} for {self.model!r} version "
            f"{self.version}, which takes float32 [N, {', '.join(map(str, self.row_shape or ()))}]",
            field="rows",
            code="invalid_rows",
        )

    def refuse(self, request: Request, error: Exception) -> None:
        """Answer a request that was never queued (refused at admission, or its rows were wrong),
        recorded as failed."""
        self.statistics.record_outcome(False, time.perf_counter_ns() - request.entered)
        request.reply(request, None, error)

    # --- the end of a request -------------------------------------------------------------------------

    def ended(self, request: Request, outputs: Outputs | None, error: Exception | None) -> None:
        """``request`` (queued here) has ended: free what it still held of the queue, record it,
        and hand its reply its outputs or the service's error (a client gone is a 499, a deadline
        passed a 503, a non-finite output a 500)."""
        if request.queue_trace is not None:
            request.queue_trace.end()  # a request given up before its batch started
        untaken = request.count - request.taken
        if untaken:  # its places in the queue are free now, not when the loop next looks
            self._queued -= untaken
            request.taken = request.count
            self._show_depth()
        elapsed = time.perf_counter_ns() - request.entered
        if error is None:  # it ran: recorded with its queue wait, its batches and its outcome
            if request.non_finite:
                try:
                    require_finite(
                        request.non_finite, request.count, self.model, self.graph, self._metrics
                    )
                except ServiceError as failure:
                    outputs, error = None, failure
            self.statistics.record_request(
                round((request.started - request.enqueued) * 1e9),
                request.batches,
                error is None,
                elapsed,
            )
        else:  # timed out, cancelled, or failed with its batch: its outcome only
            if type(error) is ClientGone:
                self._metrics.cancelled.labels(*self._labels).inc(request.remaining)
                error = ClientDisconnected(
                    f"the client went away; {request.remaining} of {request.count} images were "
                    "not run"
                )
            elif type(error) is TimedOut:
                self._reject("timeout")
                error = ServiceUnavailable(
                    f"the request was not served within request_timeout_s={self.timeout_s} s "
                    f"({request.remaining} of {request.count} images unfinished); retry after "
                    f"{self.retry_after_s} s",
                    code="timeout",
                    retry_after_s=self.retry_after_s,
                )
            self.statistics.record_outcome(False, elapsed)
        if self._lease is not None:
            self._lease.release()
        request.reply(request, outputs, error)

    def _expire(self) -> None:
        """The batcher's one deadline timer: time out every request past its deadline, then wait
        for the oldest one left."""
        self._deadline_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines = self._deadlines
        while deadlines and (deadlines[0].done or deadlines[0].deadline <= now):
            deadlines.popleft().time_out()  # a no-op for one that has ended
        if deadlines:
            self._deadline_timer = loop.call_at(deadlines[0].deadline, self._expire)

    def _show_depth(self) -> None:
        """The queue-depth gauge: each write is a locked write to shared memory in multiprocess
        mode, so only a changed depth is written."""
        if self._queued != self._depth_shown:
            self._depth_shown = self._queued
            self._depth.set(self._queued)

    def _reject(self, reason: str) -> None:
        self._metrics.rejections.labels(*self._labels, reason).inc()

    # --- what runs when -------------------------------------------------------------------------------

    def _batch_target(self, waiting: int) -> int:
        """How many images to run now: the largest preferred size that is waiting, else as many as
        fit (up to the max batch size)."""
        fitting = [size for size in self.preferred_batch_sizes if size <= waiting]
        return fitting[-1] if fitting else min(waiting, self.max_batch_size)

    def _full(self, waiting: int) -> bool:
        if waiting >= self.max_batch_size:
            return True
        return bool(self.preferred_batch_sizes) and waiting >= self.preferred_batch_sizes[-1]

    def _oldest(self) -> Request | None:
        """The oldest request still waiting (ended ones leave the queue here)."""
        queue = self._queue
        while queue and queue[0].taken == queue[0].count:
            queue.popleft()
        return queue[0] if queue else None

    async def _loop(self) -> None:
        """Starts batches as they become due: full, or their oldest image has waited the queue delay
        (``_dispatch``); otherwise sleeps until the oldest's delay ends or something changes."""
        loop = asyncio.get_running_loop()
        while True:
            self._dispatch(loop)
            if self._closing and not self._queued and not self._instances.running:
                return
            self._wakeup.clear()
            oldest = self._oldest()
            if oldest is not None and self._instances.idle:  # not due: wait out its delay
                timer = loop.call_at(oldest.enqueued + self.max_queue_delay_s, self._wakeup.set)
                try:
                    await self._wakeup.wait()
                finally:
                    timer.cancel()
            else:
                await self._wakeup.wait()

    def _idle_due(self) -> bool:
        """With every instance idle, what is queued runs now rather than after the queue delay: the
        requests of one loop turn are queued together before this runs, what queued while a batch
        ran runs as it ends, and a lone client is not held for partners that are not coming."""
        return self.idle_dispatch and self._instances.all_idle

    def _freed(self) -> None:
        """An instance finished its batch: it takes the next due one now, before that batch's
        requests are answered."""
        self._dispatch(asyncio.get_running_loop())
        self._wake_if_waiting()

    def _dispatch_later(self) -> None:
        """What was queued in the last turn of the event loop: start what is due (a failure here
        is the batching loop's: the watchdog's)."""
        self._dispatch_due = False
        try:
            self._dispatch(asyncio.get_running_loop())
        except Exception as failure:
            if self._task is not None:
                self._task.cancel()
            self._died(failure)
            return
        self._wake_if_waiting()

    def _wake_if_waiting(self) -> None:
        """Wake the batching loop only when it has something to wait for: images queued while an
        instance is idle (their queue delay), or the end of a drain. Under load, with every instance
        busy, a finished batch starts the next one itself and the loop sleeps on."""
        if (self._queued and self._instances.idle) or self._closing:
            self._wakeup.set()

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start every batch that is due on an idle instance, now (not in a later loop turn)."""
        instances = self._instances
        while instances.idle and self._queued:
            oldest = self._oldest()
            assert oldest is not None
            waiting = self._queued
            due = self._idle_due() or oldest.enqueued + self.max_queue_delay_s <= loop.time()
            if not (due or self._flushing or self._full(waiting)):
                break
            target = self._batch_target(waiting)
            batch: list[Segment] = []
            images = 0
            queue = self._queue
            while images < target:
                request = queue[0]
                left = request.count - request.taken
                if not left:  # ended while queued
                    queue.popleft()
                    continue
                take = min(left, target - images)
                batch.append((request, request.taken, take))
                request.taken += take
                images += take
                if request.taken == request.count:
                    queue.popleft()
            self._queued -= images
            instances.start(batch, images, not self._queued, loop)
        self._show_depth()

    # --- shutdown -------------------------------------------------------------------------------------

    def fail_all(self, message: str, code: str = "shutting_down") -> int:
        """Fail every queued image and every image of a running batch (503); how many were failed."""
        unanswered: dict[Request, int] = {}
        for request in self._queue:
            if request.taken < request.count:
                unanswered[request] = unanswered.get(request, 0) + request.count - request.taken
        for request, _, count in self._instances.unanswered():
            unanswered[request] = unanswered.get(request, 0) + count
        self._instances.abandon_running()
        for request in unanswered:
            request.fail(ServiceUnavailable(message, code=code, retry_after_s=self.retry_after_s))
        self._queue.clear()
        return sum(unanswered.values())

    def flush(self) -> None:
        """From now on run what is queued without waiting for the queue delay (shutdown has begun:
        nothing should wait for a batch to fill)."""
        self._flushing = True
        self._wakeup.set()

    def close(self) -> None:
        """Accept no new work; run what is queued without waiting for the queue delay."""
        self._closing = True
        self.flush()

    async def stop(self, timeout_s: float) -> int:
        """Stop taking work, run everything already queued, then release the worker threads.
        Returns how many images had to be failed because the drain did not finish in time."""
        self.close()
        failed = 0
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                failed = self.fail_all(
                    "the service shut down before this request was answered", "shutting_down"
                )
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._instances.shutdown(wait=failed == 0)
        return failed
