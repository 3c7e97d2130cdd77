"""Shadow evaluation: a candidate version runs copies of the live version's requests, never answering them.

A model's ``config.pbtxt`` names the candidate and the share of live requests it shadows
(:class:`~service.contract.candidate_plan.CandidatePlan`). The front end draws the share per classifier
call (``ModelView.shadow``) and marks the call: when both versions take the same rows the candidate
runs a copy of the call's rows; when the candidate takes other rows (another input size, crop, mean
and std, channels: ``service/contract/candidates.py``'s ``shadow_rows``) the front end prepares the
candidate's own rows from the same images and sends them with the call; a call the candidate cannot
run (a tensor for another input, a candidate with other labels) is counted ``incompatible``. The
copies wait for the live answer, then join a bounded shadow queue. The queue runs on the candidate,
one batch at a time on a thread of its own, only while neither version has work waiting and each has
an idle instance (``DynamicBatcher.spare``): the shadow never sits in a batcher's queue, so no live
request waits behind it, and under load the shadow queue fills and its overflow is shed (counted). A
shadow that fails or passes its timeout is counted; the live caller never sees it, since it has its
answer before the copy runs.

The comparison, per (live, candidate) pair (:class:`Comparison`): requests and images compared, top-1
agreement, the probability difference of each image (the largest ``|p_live - p_candidate|`` over its
classes; mean over every image, p99 over the latest ``comparison.WINDOW``) and the top-1 confusion (live class ->
candidate class). The model time is measured as a pair: each shadow batch runs on the live version
too, right before or after the candidate (alternating), on the same thread, with the same images and
batch size, so that the two times share the machine's load; the ratio is the median of those pairs'
ratios (``comparison.MODEL_TIME``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.contract.probabilities import softmax
from service.contract.table import Outputs
from service.engine.batch_runs import RunBatch, timed_run
from service.engine.comparison import Comparison
from service.observability.logs import Throttle
from service.observability.shadow_metrics import ShadowSeries

if TYPE_CHECKING:
    from service.contract.candidate_plan import CandidatePlan
    from service.engine.model_manager import ModelManager
    from service.engine.pipeline import ModelPipeline
    from service.engine.request import Request

logger = logging.getLogger("vitserve")

RETRY_S = 0.005  # a queue left waiting for busy versions is looked at again after this long
FAILURE_LOG_S = 60.0  # a candidate that keeps failing is logged once a minute (and always counted)


def observe(request: Request, seen: Callable[[Outputs | None], None]) -> None:
    """``seen(outputs)`` once ``request`` has ended, after its own reply (outputs None when it
    failed). A shadow reads the live answer this way: it cannot change what the caller gets."""
    reply = request.reply

    def replied(ended: Request, outputs: Outputs | None, error: Exception | None) -> None:
        reply(ended, outputs, error)
        seen(None if error is not None else outputs)

    request.reply = replied


@dataclass(eq=False)
class _Copy:
    """One live request's rows (and the candidate's, the same array when both take the same rows),
    waiting for the live answer, then for the candidate."""

    live_rows: np.ndarray
    candidate_rows: np.ndarray
    live: ModelPipeline
    candidate: ModelPipeline
    comparison: Comparison
    probabilities: np.ndarray | None = None


def paired_runs(
    live: RunBatch | None,
    candidate: RunBatch,
    live_rows: list[np.ndarray],
    candidate_rows: list[np.ndarray],
    live_first: bool,
) -> tuple[Outputs, float | None, float]:
    """The candidate's outputs, and each version's model time (joining and running its rows), run
    one right after the other in this thread, the live version first when ``live_first``; ``live``
    None: the candidate alone (an untimed batch: no live time)."""
    if live is None:
        outputs, times = timed_run(candidate, candidate_rows)
        return list(outputs), None, (times.compute_input_ns + times.compute_infer_ns) / 1e9
    runs = [(live, live_rows), (candidate, candidate_rows)]
    done = [timed_run(run, rows) for run, rows in (runs if live_first else runs[::-1])]
    (_, live_times), (outputs, candidate_times) = done if live_first else done[::-1]
    seconds = [
        (t.compute_input_ns + t.compute_infer_ns) / 1e9 for t in (live_times, candidate_times)
    ]
    return list(outputs), seconds[0], seconds[1]


class ModelShadow:
    """One model's shadow queue and the thread its candidate runs on, at lower priority than any
    live work of the model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0  # copies offered and not yet run, shed or dropped (the queue's bound)
        self.ready: deque[_Copy] = deque()  # copies whose live answer has come
        self.running = False
        self.live_first = True  # the order of the next timed pair (alternating)
        self._retry: asyncio.TimerHandle | None = None
        self._failure_log = Throttle(FAILURE_LOG_S)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"vitserve-shadow-{name}")

    def offer(
        self,
        request: Request,
        candidate_rows: np.ndarray | None,
        live: ModelPipeline,
        candidate: ModelPipeline,
        comparison: Comparison,
        plan: CandidatePlan,
    ) -> None:
        """A copy of ``request``'s rows (and of ``candidate_rows``, the candidate's own, when it
        takes others) for the candidate once it is answered; shed when the queue is full. The rows
        are copied now: the caller's may be freed once it is answered."""
        if self.pending >= plan.shadow_queue_size:
            comparison.count("shed")
            return
        self.pending += 1
        live_rows = np.array(request.rows, copy=True)
        own = live_rows if candidate_rows is None else np.array(candidate_rows, copy=True)
        copy = _Copy(live_rows, own, live, candidate, comparison)

        def answered(outputs: Outputs | None) -> None:
            if outputs is None:
                self.pending -= 1
                comparison.count("live_failed")
                return
            copy.probabilities = softmax(outputs[0])
            self.ready.append(copy)
            self.pump(plan)

        observe(request, answered)

    def pump(self, plan: CandidatePlan) -> None:
        """Start the next shadow batch if the model has nothing else to do; else look again soon
        (or when the next live call is answered)."""
        if self.running or not self.ready:
            return
        first = self.ready[0]
        if not (first.live.classifier.spare and first.candidate.classifier.spare):
            if self._retry is None:
                self._retry = asyncio.get_running_loop().call_later(RETRY_S, self._again, plan)
            return
        live, candidate = first.live, first.candidate
        batch = [self.ready.popleft()]
        rows = len(first.live_rows)
        most = min(candidate.serving.max_batch_size, live.serving.max_batch_size)
        while (
            self.ready
            and self.ready[0].candidate is candidate
            and self.ready[0].live is live
            and rows + len(self.ready[0].live_rows) <= most
        ):
            rows += len(self.ready[0].live_rows)
            batch.append(self.ready.popleft())
        if not (candidate.accepting and live.accepting):  # released since the copies were made
            self._settle(batch, "shed")
            self.pump(plan)
            return
        self._start(batch, live, candidate, plan)

    def _again(self, plan: CandidatePlan) -> None:
        self._retry = None
        self.pump(plan)

    def _start(
        self,
        batch: list[_Copy],
        live: ModelPipeline,
        candidate: ModelPipeline,
        plan: CandidatePlan,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.running = True
        for pipeline in (live, candidate):
            pipeline.hold()  # neither version is released under a running shadow
        timed = batch[0].comparison.time_next()
        live_first = self.live_first
        if timed:
            self.live_first = not live_first
        future = loop.run_in_executor(
            self._executor,
            paired_runs,
            live.runtime.classify_with(0) if timed else None,
            candidate.runtime.classify_with(0),
            [copy.live_rows for copy in batch],
            [copy.candidate_rows for copy in batch],
            live_first,
        )
        outcome: dict[str, Any] = {}

        def timed_out() -> None:
            outcome["timeout"] = True
            self._settle(batch, "timeout")

        deadline = loop.call_later(plan.shadow_timeout_s, timed_out)

        def ended(done: asyncio.Future) -> None:
            deadline.cancel()
            for pipeline in (live, candidate):
                pipeline.release()
            self.running = False
            if not outcome:
                self._compare(batch, done)
            self.pump(plan)

        future.add_done_callback(ended)

    def _compare(self, batch: list[_Copy], done: asyncio.Future) -> None:
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            if self._failure_log.due():
                logger.warning(
                    "the shadow of %s on candidate version %s failed: %r (counted in its "
                    "outcomes; logged at most once a minute)",
                    self.name,
                    batch[0].candidate.version,
                    error,
                )
            self._settle(batch, "failed")
            return
        outputs, live_s, candidate_s = done.result()
        if live_s is not None:
            batch[0].comparison.timed(live_s, candidate_s)
        at = 0
        try:
            for copy in batch:
                count = len(copy.candidate_rows)
                candidate = softmax(outputs[0][at : at + count])
                if candidate.shape != copy.probabilities.shape:  # type: ignore[union-attr]
                    raise ValueError(
                        f"the candidate answered {list(candidate.shape)} for live's "
                        f"{list(copy.probabilities.shape)}"  # type: ignore[union-attr]
                    )
                copy.comparison.add(copy.probabilities, candidate)  # type: ignore[arg-type]
                self.pending -= 1
                at += count
        except ValueError as error:
            logger.warning("the shadow of %s cannot be compared: %s", self.name, error)
            self._settle(batch[batch.index(copy) :], "failed")

    def _settle(self, batch: list[_Copy], outcome: str) -> None:
        for copy in batch:
            copy.comparison.count(outcome)
        self.pending -= len(batch)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


class Shadows:
    """Every model's shadow and comparisons, fed by the engine's calls (``Engine.submit``)."""

    def __init__(self, manager: ModelManager, series: ShadowSeries) -> None:
        self.manager = manager
        self.series = series
        self.models: dict[str, ModelShadow] = {}
        self.comparisons: dict[tuple[str, int, int], Comparison] = {}

    def offer(self, pipeline: ModelPipeline, requests: list[Request]) -> None:
        """Shadow each of ``requests`` that its front end marked (the draw of the model's shadow
        share), about to be queued on ``pipeline``'s classifier, when ``pipeline`` is still its
        model's live version and the candidate is ready; a mark that no longer fits the versions
        (the front end's table was older) is counted incompatible."""
        marked = [request for request in requests if request.shadow is not None]
        model = self.manager.models.get(pipeline.name)
        if not marked or model is None:
            return
        plan = model.plan
        if not plan.shadowing or pipeline.version != model.live_version():
            return
        candidate = model.pipeline(plan.candidate_version)
        if candidate is None or candidate is pipeline:
            return
        shadow = self.models.get(pipeline.name)
        if shadow is None:
            shadow = self.models[pipeline.name] = ModelShadow(pipeline.name)
        comparison = self.comparison(model.name, pipeline.version, candidate.version)
        rows = (model.comparison() or ("none", ""))[0]
        for request in marked:
            mark, own = request.shadow  # type: ignore[misc]
            fits = mark == rows and (
                own is None or tuple(own.shape[1:]) == candidate.view.row_shape
            )
            if not fits:
                comparison.count("incompatible")
                continue
            shadow.offer(request, own, pipeline, candidate, comparison, plan)

    def comparison(self, name: str, live: int, candidate: int) -> Comparison:
        key = (name, live, candidate)
        if key not in self.comparisons:
            self.comparisons[key] = Comparison(name, live, candidate, self.series)
        return self.comparisons[key]

    def report(self, name: str) -> dict[str, Any]:
        """``GET /models/{name}/shadow``: the model's plan and every pair compared since the engine
        started."""
        model = self.manager.model(name)
        plan = model.plan
        shadow = self.models.get(model.name)
        rows = model.comparison()
        return {
            "model": model.name,
            "live_version": model.live_version(),
            "candidate_version": plan.candidate_version,
            "candidate_ready": plan.candidate_version in model.ready_versions(),
            "comparable": None if rows is None else rows[0] != "none",
            "rows": None if rows is None else rows[0],
            "why": None if rows is None else rows[1],
            "shadow_percent": plan.shadow_percent,
            "canary_percent": plan.canary_percent,
            "shadow_queue": {
                "size": plan.shadow_queue_size,
                "waiting": shadow.pending if shadow is not None else 0,
                "timeout_s": plan.shadow_timeout_s,
            },
            "pairs": [
                comparison.report()
                for (owner, _, _), comparison in sorted(self.comparisons.items())
                if owner == model.name
            ],
        }

    def close(self) -> None:
        for shadow in self.models.values():
            shadow.close()
