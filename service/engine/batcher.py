"""A dynamic batcher in the manner of Triton's: bounded queue, max batch size, max queue delay, preferred
batch sizes, and several model instances running batches at once.

Every image is one queue item, so a request holding several images may be split across batches. When every
instance is idle, what is queued runs at once instead of waiting for partners that may not come (the
requests that arrive in one turn of the event loop still run together, and what queued while a batch ran
runs as soon as it ends), unless ``idle_dispatch`` is off. Otherwise a batch runs when the largest preferred
size is waiting (else the max batch size), or when its oldest image has waited ``max_queue_delay`` (then at
the largest preferred size that is waiting, else all that fit), and an instance is idle: each instance is a
run function with its own worker thread (and, in the service, its own onnxruntime session), so up to
``instances`` batches run at once while the next one fills. Each caller gets its own rows back. Admission is
all-or-nothing and immediate: when a request's images do not fit in the queue it is answered 503 with
``Retry-After`` without waiting. A request not finished within its timeout gets 503; one whose client went
away is cancelled and its images never run. A failing model run fails only the requests in that batch.
``close()`` makes the queue run without waiting for the delay (shutdown); ``stop()`` drains it and says how
many images it had to fail. A request's images and their one future are in
``service/engine/batch_request.py``, with the :data:`Outputs` a request is answered with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.engine.batch_request import BatchRequest, ClientGone, QueueItem, TimedOut
from service.engine.output_checks import finite_rows, require_finite
from service.engine.statistics import BatchTimes, ModelStatistics
from service.errors import ClientDisconnected, InferenceFailed, ServiceUnavailable
from service.link.protocol import Outputs
from service.observability import tracing
from service.observability.metrics import Metrics

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger("vitserve")

RunBatch = Callable[[np.ndarray], Sequence[np.ndarray]]

# A lone image whose last lone run took at most this long runs on the event loop when nothing else is
# queued or running: the hop to the instance's thread and back (two thread wake-ups) costs more than
# blocking the loop this long, and nothing could run meanwhile anyway. A slower model keeps its thread.
INLINE_RUN_MAX_S = 0.002


@dataclass(eq=False)
class _Instance:
    run: RunBatch
    executor: ThreadPoolExecutor
    index: int = 0


def _timed(run: RunBatch, rows: list[np.ndarray]) -> tuple[Sequence[np.ndarray], BatchTimes]:
    """Stack ``rows`` and ``run`` them, timing both (in the instance's thread, off the event loop)."""
    stacking = time.perf_counter_ns()
    images = np.stack(rows) if len(rows) > 1 else rows[0][np.newaxis]
    stacked = time.perf_counter_ns()
    outputs = run(images)
    return outputs, BatchTimes(stacked - stacking, time.perf_counter_ns() - stacked, 0)


class DynamicBatcher:
    def __init__(
        self,
        graph: str,
        run: RunBatch | Sequence[RunBatch],
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        timeout_s: float,
        retry_after_s: int,
        metrics: Metrics,
        model: str = "",
        preferred_batch_sizes: Sequence[int] = (),
        statistics: ModelStatistics | None = None,
        idle_dispatch: bool = True,
    ) -> None:
        self.graph = graph
        self.model = model
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
        self._labels = (model, graph)
        self._depth = metrics.queue_depth.labels(*self._labels)
        self._queue_wait = metrics.queue_wait.labels(*self._labels)
        self._compute = metrics.compute.labels(*self._labels)
        self._batch_size = metrics.batch_size.labels(*self._labels)
        runs = [run] if callable(run) else list(run)
        self._instances = [
            _Instance(fn, ThreadPoolExecutor(1, thread_name_prefix=f"vitserve-{graph}-{i}"), i)
            for i, fn in enumerate(runs)
        ]
        self._idle: list[_Instance] = list(self._instances)
        self._running: dict[asyncio.Task, list[QueueItem]] = {}
        self._pending: deque[QueueItem] = deque()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._flushing = False
        self._task: asyncio.Task | None = None
        self.failure: BaseException | None = None
        self._lone_run_s = float("inf")  # how long the last batch of one image took to run

    @property
    def healthy(self) -> bool:
        """False once the batching loop has died; readiness reports it."""
        return self._task is not None and self.failure is None

    @property
    def accepting(self) -> bool:
        """Takes new work: started, not failed, not closing."""
        return self.healthy and not self._closing

    @property
    def spare(self) -> bool:
        """Nothing waits and an instance is idle: work of lower priority may run now."""
        return not self._pending and bool(self._idle)

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
        self.failure = task.exception()
        logger.error(
            "the %s batcher of %s stopped: %r", self.graph, self.model or "-", self.failure
        )
        self.fail_all("the batcher stopped; retry on another instance", "batcher_failed")

    def admit(self, count: int) -> None:
        """Raise the 503 that ``submit`` would raise for ``count`` images now.

        Callers check before decoding, so that an overloaded service refuses at once instead of
        decoding images it cannot queue; ``submit`` checks again, as the queue moves meanwhile.
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
        if len(self._pending) + count > self.max_queue_size:
            self._reject("queue_full")
            raise ServiceUnavailable(
                f"the {self.graph} queue is full: {len(self._pending)} images waiting, this request adds "
                f"{count}, the limit is max_queue_size={self.max_queue_size}; retry after "
                f"{self.retry_after_s} s",
                code="queue_full",
                retry_after_s=self.retry_after_s,
            )

    async def submit(
        self,
        rows: np.ndarray,
        request_id: str | None = None,
        disconnected: Awaitable[object] | None = None,
        alone: bool = False,
    ) -> Outputs:
        """Queue ``rows`` (one image each) and return every output, stacked over them in order:
        :meth:`enqueue`, then :meth:`answer`."""
        return await self.answer(self.enqueue(rows, request_id, alone), disconnected)

    def enqueue(
        self, rows: np.ndarray, request_id: str | None = None, alone: bool = False
    ) -> BatchRequest:
        """Queue ``rows`` (one image each), or raise the 503 of :meth:`admit`. ``alone``: the caller
        knows no other request will join this one in this turn of the event loop, so with every
        instance idle its images start here and now, not in the batching loop's next turn; a lone
        image run inline is answered before this returns (:meth:`finish` hands it over at once)."""
        count = len(rows)
        self.admit(count)
        loop = asyncio.get_running_loop()
        request = BatchRequest(loop.create_future(), count, loop.time(), tracing.enter_queue(count))
        self._pending.extend(QueueItem(rows[i], request, i, request_id) for i in range(count))
        if alone and self._idle_due():
            self._dispatch(loop)
        else:
            self._depth.set(len(self._pending))
        if self._pending:
            self._wakeup.set()
        return request

    async def answer(
        self, request: BatchRequest, disconnected: Awaitable[object] | None = None
    ) -> Outputs:
        """The outputs of a queued request once its images have all run. ``disconnected``
        completes when the client has gone: the images still queued are then cancelled (they never
        run) and :class:`ClientDisconnected` is raised."""
        try:
            await request.wait(request.enqueued + self.timeout_s, disconnected)
        except Exception:  # the request's error: raised by _ended, as finish() would give it
            pass
        except BaseException:  # the caller itself was cancelled
            self._settle(request)
            raise
        return self._ended(request)

    def finish(
        self, request: BatchRequest, answer: Callable[[Outputs | None, Exception | None], None]
    ) -> None:
        """Hand ``answer`` the request's outputs (or its error) once its images have all run, or
        its deadline has passed: now, for a request answered already (run inline by
        :meth:`enqueue`). The end of a request that nobody awaits: no task, no future of its own;
        :meth:`BatchRequest.fail` with :class:`ClientGone` cancels it."""
        if request.future.done():
            self._hand(request, answer)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.call_at(request.enqueued + self.timeout_s, request.time_out)

        def ended(_: asyncio.Future) -> None:
            deadline.cancel()
            self._hand(request, answer)

        request.future.add_done_callback(ended)

    def _hand(
        self, request: BatchRequest, answer: Callable[[Outputs | None, Exception | None], None]
    ) -> None:
        try:
            outputs = self._ended(request)
        except Exception as error:
            answer(None, error)
        else:
            answer(outputs, None)

    def _ended(self, request: BatchRequest) -> Outputs:
        """An answered request, settled and counted: its outputs, or its error as the service's
        (a client gone is a 499, a deadline passed a 503)."""
        self._settle(request)
        try:
            return self._counted(request)
        except ClientGone:
            self._metrics.cancelled.labels(*self._labels).inc(request.remaining)
            raise ClientDisconnected(
                f"the client went away; {request.remaining} of {request.count} images were not run"
            ) from None
        except TimedOut:
            self._reject("timeout")
            raise ServiceUnavailable(
                f"the request was not served within request_timeout_s={self.timeout_s} s "
                f"({request.remaining} of {request.count} images unfinished); retry after "
                f"{self.retry_after_s} s",
                code="timeout",
                retry_after_s=self.retry_after_s,
            ) from None

    def _settle(self, request: BatchRequest) -> None:
        """A request answered or given up: nothing of it stays behind."""
        if request.queue_trace is not None:
            request.queue_trace.end()  # a request given up before its batch started
        if request.remaining:  # free its places in the queue now, not when the loop next looks
            self._pending = deque(item for item in self._pending if not item.abandoned)
            self._depth.set(len(self._pending))

    def _counted(self, request: BatchRequest) -> Outputs:
        """An answered request's outputs, in its statistics; its error, raised."""
        outputs = request.future.result()
        self.statistics.record_request(
            round((request.started - request.enqueued) * 1e9), request.batches
        )
        require_finite(request.non_finite, request.count, self.model, self.graph, self._metrics)
        return outputs

    def _reject(self, reason: str) -> None:
        self._metrics.rejections.labels(*self._labels, reason).inc()

    def _drop_abandoned(self) -> None:
        while self._pending and self._pending[0].abandoned:
            self._pending.popleft()

    def _batch_target(self, waiting: int) -> int:
        """How many images to run now: the largest preferred size that is waiting, else as many as
        fit (up to the max batch size)."""
        fitting = [size for size in self.preferred_batch_sizes if size <= waiting]
        return fitting[-1] if fitting else min(waiting, self.max_batch_size)

    def _full(self, waiting: int) -> bool:
        if waiting >= self.max_batch_size:
            return True
        return bool(self.preferred_batch_sizes) and waiting >= self.preferred_batch_sizes[-1]

    async def _loop(self) -> None:
        """Starts batches as they become due: full, or their oldest image has waited the queue delay
        (``_dispatch``); otherwise sleeps until the oldest's delay ends or something changes."""
        loop = asyncio.get_running_loop()
        while True:
            self._dispatch(loop)
            if self._closing and not self._pending and not self._running:
                return
            self._wakeup.clear()
            if self._pending and self._idle:  # not due yet: wait out the oldest image's delay
                due = self._pending[0].request.enqueued + self.max_queue_delay_s - loop.time()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), max(due, 0.0))
            else:
                await self._wakeup.wait()

    def _idle_due(self) -> bool:
        """With every instance idle, what is queued runs now rather than after the queue delay: the
        requests of one loop turn are queued together before this runs, what queued while a batch
        ran runs as it ends, and a lone client is not held for partners that are not coming.
        (Waiting whenever the last request came less than a delay after the one before held every
        other request of one client for the whole delay, once the service answered faster than it.)"""
        return self.idle_dispatch and len(self._idle) == len(self._instances)

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start every batch that is due on an idle instance, now (not in a later loop turn: this runs
        as soon as an instance finishes, before its callers are answered)."""
        while self._idle:
            self._drop_abandoned()
            waiting = len(self._pending)
            if not waiting:
                break
            due = self._idle_due() or (
                self._pending[0].request.enqueued + self.max_queue_delay_s <= loop.time()
            )
            if not (due or self._flushing or self._full(waiting)):
                break
            target = self._batch_target(waiting)
            batch: list[QueueItem] = []
            while self._pending and len(batch) < target:
                item = self._pending.popleft()
                if not item.abandoned:
                    batch.append(item)
            if batch:
                self._start(batch, self._idle.pop(), loop)
        self._depth.set(len(self._pending))

    def _start(
        self, batch: list[QueueItem], instance: _Instance, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Hand ``batch`` to ``instance``'s thread at once; a task answers its callers when it ends.
        A lone image of a fast model runs here instead (``INLINE_RUN_MAX_S``)."""
        started = loop.time()
        for item in batch:
            self._queue_wait.observe(started - item.request.enqueued)
        span = tracing.start_batch(
            self.model, self.graph, instance.index, (item.request.queue_trace for item in batch)
        )
        if (
            len(batch) == 1
            and self._lone_run_s <= INLINE_RUN_MAX_S
            and not self._pending
            and not self._running
        ):
            self._run_inline(batch, instance, started, span, loop)
            return
        running = instance.executor.submit(_timed, instance.run, [item.row for item in batch])
        task = loop.create_task(self._finish(batch, instance, running, started, span))
        self._running[task] = batch

    async def _finish(
        self,
        batch: list[QueueItem],
        instance: _Instance,
        running: Future,
        started: float,
        span: Span | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        error: Exception | None = None
        try:
            try:
                outputs, times = await asyncio.wrap_future(running)
                self._check_rows(outputs, batch)
            except Exception as failure:
                error = failure
            finally:  # the instance takes the next batch before this one's callers are answered
                self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
                self._idle.append(instance)
                self._dispatch(loop)
                self._wakeup.set()
            if error is not None:
                self._fail_batch(batch, error)
            else:
                self._deliver(batch, outputs, times, started, loop)
        finally:
            tracing.end_batch(span, error)

    def _run_inline(
        self,
        batch: list[QueueItem],
        instance: _Instance,
        started: float,
        span: Span | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        error: Exception | None = None
        try:
            outputs, times = _timed(instance.run, [item.row for item in batch])
            self._check_rows(outputs, batch)
        except Exception as failure:
            error = failure
        finally:
            self._idle.append(instance)
        try:
            if error is not None:
                self._fail_batch(batch, error)
            else:
                self._deliver(batch, outputs, times, started, loop)
        finally:
            tracing.end_batch(span, error)

    @staticmethod
    def _check_rows(outputs: Sequence[np.ndarray], batch: list[QueueItem]) -> None:
        for output in outputs:
            if len(output) != len(batch):
                raise RuntimeError(
                    f"the model returned {len(output)} rows for a batch of {len(batch)}"
                )

    def _fail_batch(self, batch: list[QueueItem], error: BaseException) -> None:
        self._metrics.inference_failures.labels(*self._labels).inc()
        request_ids = sorted({item.request_id for item in batch if item.request_id})
        logger.exception(
            "%s batch of %d images failed (requests %s)",
            self.graph,
            len(batch),
            ", ".join(request_ids) or "-",
            exc_info=error,
        )
        message = (
            f"the model failed on the batch holding this request ({type(error).__name__}); "
            "quote the request id when reporting it"
        )
        for item in batch:
            item.request.fail(InferenceFailed(message))

    def _deliver(
        self,
        batch: list[QueueItem],
        outputs: Sequence[np.ndarray],
        times: BatchTimes,
        started: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._compute.observe(loop.time() - started)
        self._batch_size.observe(len(batch))
        if len(batch) == 1:
            self._lone_run_s = times.compute_infer_ns / 1e9
        finite = finite_rows(outputs, len(batch))
        # each request's images are one run of the batch (they queue together, in order): the run's
        # rows of every output go to it at once
        splitting = time.perf_counter_ns()
        runs, at = [], 0
        while at < len(batch):
            request, end = batch[at].request, at + 1
            while end < len(batch) and batch[end].request is request:
                end += 1
            non_finite = 0 if finite is None else int(end - at - finite[at:end].sum())
            runs.append(
                (request, batch[at].index, [output[at:end] for output in outputs], non_finite)
            )
            at = end
        times = BatchTimes(
            times.compute_input_ns, times.compute_infer_ns, time.perf_counter_ns() - splitting
        )
        self.statistics.record_batch(len(batch), times)
        for request, first, rows, non_finite in runs:
            request.deliver(first, rows, started, times, non_finite)

    def fail_all(self, message: str, code: str = "shutting_down") -> int:
        """Fail every queued image and every image of a running batch (503); how many were failed."""
        unanswered = [
            item
            for item in [*self._pending, *(i for batch in self._running.values() for i in batch)]
            if not item.abandoned
        ]
        self._pending.clear()
        for task in self._running:
            task.cancel()  # the thread runs on, but nobody waits for it any more
        for item in unanswered:
            item.request.fail(
                ServiceUnavailable(message, code=code, retry_after_s=self.retry_after_s)
            )
        return len(unanswered)

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
        for instance in self._instances:
            instance.executor.shutdown(wait=failed == 0)
        return failed
