"""A batcher's model instances and the batches they run: each instance a run function with its own worker
thread (in the service, its own onnxruntime session), so up to ``instances`` batches run at once.

A batch is a list of :data:`Segment`: a run of one request's images, in order. It is handed to an idle
instance's thread at once, or, a lone image of a fast model with nothing else queued or running, run on
the event loop (``INLINE_RUN_MAX_S``). The instance's thread also checks the batch's outputs (a row per
image, which rows are finite) and cuts them into each request's rows; it then puts the finished batch on
the batcher's list of finished ones and wakes the event loop only when that list was empty, so batches
that finish close together cost the loop one wake-up, and no task or future per batch. On the loop, an
instance that finished is idle again and takes the next due batch (``on_free``) before the finished
batch's requests are answered; each request gets its images' rows of every output at once. A failing
run fails only the requests of its batch.

Strict JSON out: no answer carries NaN or Infinity. A model whose outputs for an image hold a non-finite
number answers that image's request 500 naming the model (``non_finite_output``, counted in
``vitserve_non_finite_outputs_total``); the other requests of the same batch are answered as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

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


class _Instance:
    """One model instance: its run function and the thread that runs its batches, one at a time, in
    the order handed over (started with the first; a queue and a thread, not an executor: no
    future and no pool bookkeeping a batch)."""

    def __init__(self, run: RunBatch, name: str, index: int) -> None:
        self.run = run
        self.name = name
        self.index = index
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            # a daemon: a batcher never stopped (a test's) does not keep the interpreter alive
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # the thread goes on to the next batch
                logger.exception("instance %s failed to hand a batch back", self.name)

    def shutdown(self, wait: bool) -> None:
        """Run what was handed over, then end the thread; ``wait``: until it has."""
        if self._thread is None:
            return
        self._jobs.put(None)
        if wait:
            self._thread.join()


@dataclass(eq=False)
class _Job:
    """One batch on one instance, from its start to its requests' answers. The instance's thread
    fills in ``rows`` (each segment's rows of every output), ``non_finite`` (each segment's images
    with a NaN or Infinity) and ``times``, or ``error``."""

    batch: list[Segment]
    images: int
    instance: _Instance
    started: float  # event-loop time
    span: Span | None
    waits: list[tuple[float, int]]  # (seconds waited in the queue, images that waited as long)
    # the segments' rows, taken on the loop as the batch starts: a request cancelled before the
    # instance's thread gets to the batch lets its own rows go, and the batch runs on
    parts: list[np.ndarray]
    rows: list[list[np.ndarray]] = field(default_factory=list)
    non_finite: list[int] = field(default_factory=list)
    times: BatchTimes | None = None
    error: Exception | None = None
    abandoned: bool = False  # nobody waits for it any more (its requests were failed)


def batch_parts(batch: list[Segment]) -> list[np.ndarray]:
    """The rows of ``batch``'s segments, in order (views: one request's rows as they are when it is
    the whole batch). Taken on the loop as the batch starts: a request that ends after that lets its
    own reference go, and the batch still holds the rows it runs."""
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


def finite_rows(outputs: Sequence[np.ndarray], count: int) -> np.ndarray | None:
    """Which of a batch's ``count`` rows hold only finite numbers in every output; None when all
    do (the usual case, checked with one pass over each output instead of one per row)."""
    if all(np.isfinite(output).all() for output in outputs):
        return None
    finite = np.ones(count, dtype=bool)
    for output in outputs:
        finite &= np.isfinite(output.reshape(count, -1)).all(axis=1)
    return finite


def require_finite(bad: int, count: int, model: str, graph: str, metrics: Metrics) -> None:
    """Raise a 500 naming ``model`` when ``bad`` of a request's ``count`` images held NaN or
    Infinity."""
    if bad:
        metrics.non_finite_outputs.labels(model, graph).inc(bad)
        raise InferenceFailed(
            f"model '{model}' ({graph} graph) produced NaN or Infinity for {bad} of "
            f"{count} images; no answer is given for them",
            code="non_finite_output",
        )


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
        self._all = [_Instance(fn, f"vitserve-{graph}-{i}", i) for i, fn in enumerate(runs)]
        self.idle: list[_Instance] = list(self._all)
        self.running: set[_Job] = set()
        self._lone_run_s = float("inf")  # how long the last batch of one image took to run
        self._loop: asyncio.AbstractEventLoop | None = None
        # batches the instances' threads finished, for the loop to answer; the loop is woken once
        # for all of them (``_wake_pending``: a wake-up is on its way)
        self._lock = threading.Lock()
        self._finished: list[_Job] = []
        self._wake_pending = False

    def __iter__(self) -> Iterator[_Instance]:
        return iter(self._all)

    @property
    def all_idle(self) -> bool:
        return len(self.idle) == len(self._all)

    def start(
        self, batch: list[Segment], images: int, inline: bool, loop: asyncio.AbstractEventLoop
    ) -> None:
        """Hand ``batch`` (``images`` in all) to an idle instance's thread at once; its requests are
        answered on the loop when it ends. ``inline`` (nothing else queued or running): a lone image
        of a fast model runs here instead."""
        instance = self.idle.pop()
        started = loop.time()
        # every image's wait; the requests queued in one turn (most of a batch) share theirs
        waits = []
        enqueued, images_then = batch[0][0].enqueued, 0
        for request, _, count in batch:
            if request.enqueued != enqueued:
                waits.append((started - enqueued, images_then))
                enqueued, images_then = request.enqueued, 0
            images_then += count
        waits.append((started - enqueued, images_then))
        span = tracing.start_batch(
            self.model, self.graph, instance.index, (segment[0].queue_trace for segment in batch)
        )
        job = _Job(batch, images, instance, started, span, waits, batch_parts(batch))
        if inline and images == 1 and self._lone_run_s <= INLINE_RUN_MAX_S and not self.running:
            self._run(job)
            self.idle.append(instance)
            self._answer(job)
            return
        self._loop = loop
        self.running.add(job)
        instance.submit(lambda: self._run_and_post(job))

    def _run(self, job: _Job) -> None:
        """Run ``job``'s batch, check its outputs (a row per image; which rows are finite) and cut
        them into each segment's rows; a failure is kept in ``job.error``. In the instance's thread
        (or inline), with the batch's metrics: the loop is left only the answers."""
        try:
            for seconds, images in job.waits:
                observe_times(self._queue_wait, seconds, images)
            outputs, times = timed_run(job.instance.run, job.parts)
            job.parts = []  # the rows (a front end's shared memory) are let go as soon as they ran
            for output in outputs:
                if len(output) != job.images:
                    raise RuntimeError(
                        f"the model returned {len(output)} rows for a batch of {job.images}"
                    )
            finite = finite_rows(outputs, job.images)
            splitting = time.perf_counter_ns()
            if len(job.batch) == 1:
                job.rows = [list(outputs)]
                job.non_finite = [0 if finite is None else int(job.images - finite.sum())]
            else:
                at = 0
                for _, _, count in job.batch:
                    end = at + count
                    job.rows.append([output[at:end] for output in outputs])
                    job.non_finite.append(
                        0 if finite is None else int(count - finite[at:end].sum())
                    )
                    at = end
            job.times = BatchTimes(
                times.compute_input_ns, times.compute_infer_ns, time.perf_counter_ns() - splitting
            )
            self._compute.observe(times.compute_infer_ns / 1e9)
            self._batch_size.observe(job.images)
        except Exception as failure:
            job.error = failure

    def _run_and_post(self, job: _Job) -> None:
        """In the instance's thread: run the batch, then hand it to the loop, waking the loop only
        when no wake-up is on its way already."""
        self._run(job)
        with self._lock:
            self._finished.append(job)
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for them
                self._loop.call_soon_threadsafe(self._take_finished)

    def _take_finished(self) -> None:
        """On the loop: every batch finished since the last look. Each instance is idle again and
        takes the next due batch before the finished batches' requests are answered."""
        with self._lock:
            finished, self._finished = self._finished, []
            self._wake_pending = False
        finished = [job for job in finished if not job.abandoned]
        for job in finished:
            self.running.discard(job)
            self.idle.append(job.instance)
        if finished:
            self._on_free()
        for job in finished:
            try:
                self._answer(job)
            except Exception:  # one batch's fault must not keep the others' answers
                logger.exception("the answers of a %s batch could not be handed on", self.graph)

    def _answer(self, job: _Job) -> None:
        try:
            if job.error is not None:
                self._fail_batch(job.batch, job.error)
            else:
                self._deliver(job)
        finally:
            tracing.end_batch(job.span, job.error)

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

    def _deliver(self, job: _Job) -> None:
        times = job.times
        assert times is not None
        started = job.started
        if job.images == 1:
            self._lone_run_s = times.compute_infer_ns / 1e9
        self.statistics.record_batch(job.images, times)
        for (request, first, _), rows, non_finite in zip(
            job.batch, job.rows, job.non_finite, strict=True
        ):
            request.deliver(first, rows, started, times, non_finite)

    def unanswered(self) -> list[Segment]:
        """The segments of running batches whose requests have not ended."""
        return [s for job in self.running for s in job.batch if not s[0].done]

    def abandon_running(self) -> None:
        """Nobody waits for the running batches any more (their threads run on, and what they
        finish is dropped); their instances take new batches, queued behind them."""
        for job in self.running:
            job.abandoned = True
            self.idle.append(job.instance)
            tracing.end_batch(job.span, None)
        self.running.clear()

    def shutdown(self, wait: bool) -> None:
        for instance in self._all:
            instance.shutdown(wait=wait)
