"""A dynamic batcher in the manner of Triton's: bounded queue, max batch size, max queue delay.

Every image is one queue item, so a request holding several images may be split across batches. A batch
runs when it is full or when its oldest image has waited ``max_queue_delay``; it runs in a worker thread,
off the event loop, one batch at a time per graph (the next batch fills while one runs). Each caller gets
its own rows back. Admission is all-or-nothing and immediate: when a request's images do not fit in the
queue it is answered 503 with ``Retry-After`` without waiting. A request not finished within its timeout
gets 503. A failing model run fails only the requests in that batch. ``stop()`` drains the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service.errors import InferenceFailed, ServiceUnavailable
from service.metrics import Metrics

logger = logging.getLogger("vitserve")

RunBatch = Callable[[np.ndarray], Sequence[np.ndarray]]


@dataclass(eq=False)
class _Item:
    row: np.ndarray
    future: asyncio.Future
    enqueued: float
    request_id: str | None = field(default=None)


class DynamicBatcher:
    def __init__(
        self,
        graph: str,
        run: RunBatch,
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        timeout_s: float,
        retry_after_s: int,
        metrics: Metrics,
    ) -> None:
        self.graph = graph
        self._run_batch = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._metrics = metrics
        self._pending: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vitserve-{graph}")

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"batcher-{self.graph}"
        )

    def admit(self, count: int) -> None:
        """Raise the 503 that ``submit`` would raise for ``count`` images now.

        Routes call it before decoding, so that an overloaded service refuses at once instead of
        decoding images it cannot queue; ``submit`` checks again, as the queue moves meanwhile.
        """
        if self._task is None:
            raise ServiceUnavailable(
                f"the {self.graph} batcher has not started; retry shortly",
                code="not_ready",
                retry_after_s=self.retry_after_s,
            )
        if self._closing:
            self._reject("shutting_down")
            raise ServiceUnavailable(
                "the service is shutting down and accepts no new work; retry on another instance",
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
        self, rows: np.ndarray, request_id: str | None = None
    ) -> list[tuple[np.ndarray, ...]]:
        """Queue ``rows`` (one image each) and return each image's outputs, in order."""
        count = len(rows)
        self.admit(count)
        loop = asyncio.get_running_loop()
        now = loop.time()
        items = [_Item(rows[i], loop.create_future(), now, request_id) for i in range(count)]
        self._pending.extend(items)
        self._metrics.queue_depth.labels(self.graph).set(len(self._pending))
        self._wakeup.set()
        futures = [item.future for item in items]
        try:
            _, not_done = await asyncio.wait(futures, timeout=self.timeout_s)
            if not_done:
                self._reject("timeout")
                raise ServiceUnavailable(
                    f"the request was not served within request_timeout_s={self.timeout_s} s "
                    f"({len(not_done)} of {count} images unfinished); retry after {self.retry_after_s} s",
                    code="timeout",
                    retry_after_s=self.retry_after_s,
                )
            failures = [f.exception() for f in futures if f.exception() is not None]
            if failures:
                raise failures[0]
            return [future.result() for future in futures]
        finally:
            abandoned = [future for future in futures if not future.done()]
            for future in abandoned:
                future.cancel()
            if abandoned:  # free their places in the queue now, not when the loop next looks
                self._pending = deque(item for item in self._pending if not item.future.done())
                self._metrics.queue_depth.labels(self.graph).set(len(self._pending))

    def _reject(self, reason: str) -> None:
        self._metrics.rejections.labels(self.graph, reason).inc()

    def _drop_abandoned(self) -> None:
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_abandoned()
            if not self._pending:
                self._metrics.queue_depth.labels(self.graph).set(0)
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if len(self._pending) < self.max_batch_size and not self._closing:
                wait = self._pending[0].enqueued + self.max_queue_delay_s - loop.time()
                if wait > 0:
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), wait)
                    continue
            batch: list[_Item] = []
            while self._pending and len(batch) < self.max_batch_size:
                item = self._pending.popleft()
                if not item.future.done():
                    batch.append(item)
            self._metrics.queue_depth.labels(self.graph).set(len(self._pending))
            if batch:
                await self._execute(batch, loop)

    async def _execute(self, batch: list[_Item], loop: asyncio.AbstractEventLoop) -> None:
        started = loop.time()
        for item in batch:
            self._metrics.queue_wait.labels(self.graph).observe(started - item.enqueued)
        try:
            images = np.stack([item.row for item in batch])
            outputs = await loop.run_in_executor(self._executor, self._run_batch, images)
            for output in outputs:
                if len(output) != len(batch):
                    raise RuntimeError(
                        f"the model returned {len(output)} rows for a batch of {len(batch)}"
                    )
        except Exception as error:
            self._metrics.inference_failures.labels(self.graph).inc()
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
                if not item.future.done():
                    item.future.set_exception(InferenceFailed(message))
            return
        self._metrics.compute.labels(self.graph).observe(loop.time() - started)
        self._metrics.batch_size.labels(self.graph).observe(len(batch))
        for index, item in enumerate(batch):
            if not item.future.done():
                item.future.set_result(tuple(output[index] for output in outputs))

    async def stop(self, timeout_s: float) -> None:
        """Stop taking work, run everything already queued, then release the worker thread."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                logger.error(
                    "%s batcher did not drain within %.1f s; failing what is left",
                    self.graph,
                    timeout_s,
                )
                self._task.cancel()
                for item in self._pending:
                    if not item.future.done():
                        item.future.set_exception(
                            ServiceUnavailable(
                                "the service shut down before this request ran",
                                code="shutting_down",
                            )
                        )
                self._pending.clear()
        self._executor.shutdown(wait=True)
