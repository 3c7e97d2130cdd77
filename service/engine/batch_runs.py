"""A batcher's model instances and the batches they run: each instance a run function with its own worker
thread (in the service, its own onnxruntime session), so up to ``instances`` batches run at once.

A batch is a list of :data:`Segment`: a run of one request's images, in order. It is handed to an idle
instance's thread at once, or, a lone image of a fast model with nothing else queued or running, run on
the event loop (``INLINE_RUN_MAX_S``). When it ends the instance is idle again and takes the next due
batch (``on_free``) before the finished batch's requests are answered; each request gets its images'
rows of every output at once. A failing run fails only the requests of its batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.engine.output_checks import finite_rows
from service.engine.request import Request
from service.engine.statistics import BatchTimes, ModelStatistics
from service.errors import InferenceFailed
from service.observability import tracing
from service.observability.metrics import Metrics, observe_times

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger("vitserve")

RunBatch = Callable[[np.ndarray], Sequence[np.ndarray]]
Segment = tuple[Request, int, int]  # a request, its first image in the batch, how many

# A lone image whose last lone run took at most this long runs on the event loop when nothing else is
# queued or running: the hop to the instance's thread and back (two thread wake-ups) costs more than
# blocking the loop this long, and nothing could run meanwhile anyway. A slower model keeps its thread.
INLINE_RUN_MAX_S = 0.002


@dataclass(eq=False)
class _Instance:
    run: RunBatch
    executor: ThreadPoolExecutor
    index: int = 0


def batch_parts(batch: list[Segment]) -> list[np.ndarray]:
    """The rows of ``batch``'s segments, in order (views: one request's rows as they are when it is
    the whole batch). Taken as the batch starts: a request that ends meanwhile lets its rows go."""
    return [
        request.rows if count == request.count else request.rows[first : first + count]
        for request, first, count in batch
    ]


def timed_run(run: RunBatch, parts: list[np.ndarray]) -> tuple[Sequence[np.ndarray], BatchTimes]:
    """Join the batch's rows and ``run`` them, timing both (in the instance's thread, off the event
    loop, unless run inline)."""
    joining = time.perf_counter_ns()
    images = parts[0] if len(parts) == 1 else np.concatenate(parts)
    joined = time.perf_counter_ns()
    outputs = run(images)
    return outputs, BatchTimes(joined - joining, time.perf_counter_ns() - joined, 0)


class Instances:
    def __init__(
        self,
        graph: str,
        model: str,
        runs: Sequence[RunBatch],
        metrics: Metrics,
        statistics: ModelStatistics,
        on_free: Callable[[], None],
    ) -> None:
        self.graph = graph
        self.model = model
        self._metrics = metrics
        self._labels = (model, graph)
        self._queue_wait = metrics.queue_wait.labels(*self._labels)
        self._compute = metrics.compute.labels(*self._labels)
        self._batch_size = metrics.batch_size.labels(*self._labels)
        self.statistics = statistics
        self._on_free = on_free  # an instance is idle again: start what is due
        self._all = [
            _Instance(fn, ThreadPoolExecutor(1, thread_name_prefix=f"vitserve-{graph}-{i}"), i)
            for i, fn in enumerate(runs)
        ]
        self.idle: list[_Instance] = list(self._all)
        self.running: dict[asyncio.Task, list[Segment]] = {}
        self._lone_run_s = float("inf")  # how long the last batch of one image took to run

    def __iter__(self) -> Iterator[_Instance]:
        return iter(self._all)

    @property
    def all_idle(self) -> bool:
        return len(self.idle) == len(self._all)

    def start(
        self, batch: list[Segment], images: int, inline: bool, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Hand ``batch`` (``images`` in all) to an idle instance's thread at once; a task answers its
        requests when it ends. ``inline`` (nothing else queued or running): a lone image of a fast
        model runs here instead."""
        instance = self.idle.pop()
        started = loop.time()
        # every image's wait; the requests queued in one turn (most of a batch) share theirs
        enqueued, images_then = batch[0][0].enqueued, 0
        for request, _, count in batch:
            if request.enqueued != enqueued:
                observe_times(self._queue_wait, started - enqueued, images_then)
                enqueued, images_then = request.enqueued, 0
            images_then += count
        observe_times(self._queue_wait, started - enqueued, images_then)
        span = tracing.start_batch(
            self.model, self.graph, instance.index, (segment[0].queue_trace for segment in batch)
        )
        if inline and images == 1 and self._lone_run_s <= INLINE_RUN_MAX_S and not self.running:
            self._run_inline(batch, instance, started, span, loop)
            return
        running = instance.executor.submit(timed_run, instance.run, batch_parts(batch))
        task = loop.create_task(self._finish(batch, images, instance, running, started, span))
        self.running[task] = batch

    async def _finish(
        self,
        batch: list[Segment],
        images: int,
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
                _check_rows(outputs, images)
            except Exception as failure:
                error = failure
            finally:  # the instance takes the next batch before this one's requests are answered
                self.running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
                self.idle.append(instance)
                self._on_free()
            if error is not None:
                self._fail_batch(batch, error)
            else:
                self._deliver(batch, images, outputs, times, started, loop)
        finally:
            tracing.end_batch(span, error)

    def _run_inline(
        self,
        batch: list[Segment],
        instance: _Instance,
        started: float,
        span: Span | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        error: Exception | None = None
        try:
            outputs, times = timed_run(instance.run, batch_parts(batch))
            _check_rows(outputs, 1)
        except Exception as failure:
            error = failure
        finally:
            self.idle.append(instance)
        try:
            if error is not None:
                self._fail_batch(batch, error)
            else:
                self._deliver(batch, 1, outputs, times, started, loop)
        finally:
            tracing.end_batch(span, error)

    def _fail_batch(self, batch: list[Segment], error: BaseException) -> None:
        self._metrics.inference_failures.labels(*self._labels).inc()
        request_ids = sorted({r.request_id for r, _, _ in batch if r.request_id})
        logger.exception(
            "%s batch of %d images failed (requests %s)",
            self.graph,
            sum(count for _, _, count in batch),
            ", ".join(request_ids) or "-",
            exc_info=error,
        )
        message = (
            f"the model failed on the batch holding this request ({type(error).__name__}); "
            "quote the request id when reporting it"
        )
        for request, _, _ in batch:
            request.fail(InferenceFailed(message))

    def _deliver(
        self,
        batch: list[Segment],
        images: int,
        outputs: Sequence[np.ndarray],
        times: BatchTimes,
        started: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._compute.observe(loop.time() - started)
        self._batch_size.observe(images)
        if images == 1:
            self._lone_run_s = times.compute_infer_ns / 1e9
        finite = finite_rows(outputs, images)
        splitting = time.perf_counter_ns()
        runs, at = [], 0
        for request, first, count in batch:
            end = at + count
            non_finite = 0 if finite is None else int(count - finite[at:end].sum())
            rows = list(outputs) if len(batch) == 1 else [output[at:end] for output in outputs]
            runs.append((request, first, rows, non_finite))
            at = end
        times = BatchTimes(
            times.compute_input_ns, times.compute_infer_ns, time.perf_counter_ns() - splitting
        )
        self.statistics.record_batch(images, times)
        for request, first, rows, non_finite in runs:
            request.deliver(first, rows, started, times, non_finite)

    def unanswered(self) -> list[Segment]:
        """The segments of running batches whose requests have not ended."""
        return [s for batch in self.running.values() for s in batch if not s[0].done]

    def abandon_running(self) -> None:
        """Nobody waits for the running batches any more (their threads run on)."""
        for task in self.running:
            task.cancel()

    def shutdown(self, wait: bool) -> None:
        for instance in self._all:
            instance.executor.shutdown(wait=wait)


def _check_rows(outputs: Sequence[np.ndarray], images: int) -> None:
    for output in outputs:
        if len(output) != images:
            raise RuntimeError(f"the model returned {len(output)} rows for a batch of {images}")
