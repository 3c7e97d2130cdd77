"""Shadow evaluation: a candidate version runs copies of the live version's requests, never answering them.

A model's ``config.pbtxt`` names the candidate and the share of live requests it shadows
(:class:`~service.contract.model_config.CandidatePlan`). For each live classifier call picked, the rows
are copied and wait for the live answer; then they join a bounded shadow queue. The queue runs on the
candidate, one batch at a time on a thread of its own, only while neither version has work waiting and
each has an idle instance (``DynamicBatcher.spare``): the shadow never sits in a batcher's queue, so no
live request waits behind it, and under load the shadow queue fills and its overflow is shed (counted).
A shadow that fails or passes its timeout is counted; the live caller never sees it, since it has its
answer before the copy runs.

The comparison, per (live, candidate) pair (:class:`Comparison`): requests and images compared, top-1
agreement, the probability difference of each image (the largest ``|p_live - p_candidate|`` over its
classes; mean over every image, p99 over the latest ``WINDOW``), the model time of each request on each
version (the batches that carried it) and the top-1 confusion (live class -> candidate class).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.contract.probabilities import softmax
from service.engine.batch_runs import timed_run
from service.link.protocol import Graph, Outputs
from service.observability.logs import Throttle
from service.observability.shadow_metrics import ShadowSeries

if TYPE_CHECKING:
    from service.contract.model_config import CandidatePlan
    from service.engine.model_manager import ModelManager
    from service.engine.pipeline import ModelPipeline
    from service.engine.request import Request

logger = logging.getLogger("vitserve")

WINDOW = 100_000  # the latest images (and requests) the p99s are taken over
RETRY_S = 0.005  # a queue left waiting for busy versions is looked at again after this long
FAILURE_LOG_S = 60.0  # a candidate that keeps failing is logged once a minute (and always counted)
OUTCOMES = ("compared", "shed", "failed", "timeout", "live_failed", "incompatible")
DIFFERENCE = "per image, the largest |p_live - p_candidate| over its classes"


def observe(request: Request, seen: Callable[[Outputs | None, int], None]) -> None:
    """``seen(outputs, model_ns)`` once ``request`` has ended, after its own reply (outputs None when
    it failed; ``model_ns``: its batches' time in the model). A shadow reads the live answer this
    way: it cannot change what the caller gets."""
    reply = request.reply

    def replied(ended: Request, outputs: Outputs | None, error: Exception | None) -> None:
        reply(ended, outputs, error)
        model_ns = sum(times.compute_infer_ns for times in ended.batches)
        seen(None if error is not None else outputs, model_ns)

    request.reply = replied


class Comparison:
    """One (live, candidate) pair's numbers, as :func:`Comparison.report` answers them."""

    def __init__(self, model: str, live: int, candidate: int, series: ShadowSeries) -> None:
        self.live, self.candidate = live, candidate
        labels = (model, str(live), str(candidate))
        self._labels = labels
        self._series = series
        self._outcome = {o: series.requests.labels(*labels, o) for o in OUTCOMES}
        self._images = series.images.labels(*labels)
        self._agreements = series.agreements.labels(*labels)
        self._difference = series.difference.labels(*labels)
        self._latency = {r: series.latency.labels(*labels, r) for r in ("live", "candidate")}
        self.outcomes: Counter[str] = Counter()
        self.images = 0
        self.agreements = 0
        self.difference_sum = 0.0
        self.differences: deque[float] = deque(maxlen=WINDOW)
        self.model_s: dict[str, deque[float]] = {
            "live": deque(maxlen=WINDOW),
            "candidate": deque(maxlen=WINDOW),
        }
        self.confusion: Counter[tuple[int, int]] = Counter()

    def count(self, outcome: str, requests: int = 1) -> None:
        self.outcomes[outcome] += requests
        self._outcome[outcome].inc(requests)

    def add(
        self, live: np.ndarray, candidate: np.ndarray, live_s: float, candidate_s: float
    ) -> None:
        """One request compared: both versions' probabilities of its images, and the time its rows
        spent in each model."""
        live_top, candidate_top = live.argmax(axis=1), candidate.argmax(axis=1)
        differences = np.abs(live - candidate).max(axis=1)
        agreeing = int((live_top == candidate_top).sum())
        self.count("compared")
        self.images += len(live)
        self.agreements += agreeing
        self._images.inc(len(live))
        self._agreements.inc(agreeing)
        for difference in differences.tolist():
            self.difference_sum += difference
            self.differences.append(difference)
            self._difference.observe(difference)
        for role, seconds in (("live", live_s), ("candidate", candidate_s)):
            self.model_s[role].append(seconds)
            self._latency[role].observe(seconds)
        for pair in zip(live_top.tolist(), candidate_top.tolist(), strict=True):
            self.confusion[pair] += 1
            self._series.confusion.labels(*self._labels, *map(str, pair)).inc()

    def report(self) -> dict[str, Any]:
        compared = self.outcomes["compared"]
        differences = np.array(self.differences)
        times = {role: np.array(values) * 1000 for role, values in self.model_s.items()}

        def percentile(values: np.ndarray, q: float) -> float | None:
            return float(np.percentile(values, q)) if len(values) else None

        live_p50, candidate_p50 = (percentile(times[r], 50) for r in ("live", "candidate"))
        return {
            "live_version": self.live,
            "candidate_version": self.candidate,
            "requests_compared": compared,
            "images_compared": self.images,
            "top1_agreement": self.agreements / self.images if self.images else None,
            "probability_difference": {
                "definition": DIFFERENCE,
                "mean": self.difference_sum / self.images if self.images else None,
                "p99": percentile(differences, 99),
            },
            "model_ms": {
                "live_p50": live_p50,
                "live_p99": percentile(times["live"], 99),
                "candidate_p50": candidate_p50,
                "candidate_p99": percentile(times["candidate"], 99),
                "ratio_p50": candidate_p50 / live_p50 if live_p50 and candidate_p50 else None,
            },
            "confusion": [
                {"live_class": live, "candidate_class": candidate, "images": images}
                for (live, candidate), images in sorted(self.confusion.items())
            ],
            "outcomes": {outcome: self.outcomes[outcome] for outcome in OUTCOMES},
        }


@dataclass(eq=False)
class _Copy:
    """One live request's rows, waiting for the live answer, then for the candidate."""

    rows: np.ndarray
    live: ModelPipeline
    candidate: ModelPipeline
    comparison: Comparison
    probabilities: np.ndarray | None = None
    live_s: float = 0.0


class ModelShadow:
    """One model's shadow queue and the thread its candidate runs on, at lower priority than any
    live work of the model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0  # copies offered and not yet run, shed or dropped (the queue's bound)
        self.ready: deque[_Copy] = deque()  # copies whose live answer has come
        self.running = False
        self._retry: asyncio.TimerHandle | None = None
        self._failure_log = Throttle(FAILURE_LOG_S)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"vitserve-shadow-{name}")

    def offer(
        self,
        request: Request,
        live: ModelPipeline,
        candidate: ModelPipeline,
        comparison: Comparison,
        plan: CandidatePlan,
    ) -> None:
        """A copy of ``request``'s rows for the candidate once it is answered; shed when the queue is
        full. The rows are copied now: the caller's may be freed once it is answered. A candidate
        that takes other rows (another input or preprocessing) cannot run the live version's: its
        copies are counted incompatible."""
        if candidate.view.preprocessing_key != live.view.preprocessing_key:
            comparison.count("incompatible")
            return
        if self.pending >= plan.shadow_queue_size:
            comparison.count("shed")
            return
        self.pending += 1
        copy = _Copy(np.array(request.rows, copy=True), live, candidate, comparison)

        def answered(outputs: Outputs | None, model_ns: int) -> None:
            if outputs is None:
                self.pending -= 1
                comparison.count("live_failed")
                return
            copy.probabilities = softmax(outputs[0])
            copy.live_s = model_ns / 1e9
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
        candidate = first.candidate
        batch = [self.ready.popleft()]
        rows = len(first.rows)
        while (
            self.ready
            and self.ready[0].candidate is candidate
            and rows + len(self.ready[0].rows) <= candidate.serving.max_batch_size
        ):
            rows += len(self.ready[0].rows)
            batch.append(self.ready.popleft())
        if not candidate.accepting:  # released since the copies were made
            self._settle(batch, "shed")
            self.pump(plan)
            return
        self._start(batch, candidate, plan)

    def _again(self, plan: CandidatePlan) -> None:
        self._retry = None
        self.pump(plan)

    def _start(self, batch: list[_Copy], candidate: ModelPipeline, plan: CandidatePlan) -> None:
        loop = asyncio.get_running_loop()
        self.running = True
        candidate.hold()  # the candidate is not released under a running shadow
        rows = [copy.rows for copy in batch]
        run = candidate.runtime.classify_with(0)
        future = loop.run_in_executor(self._executor, timed_run, run, rows)
        outcome: dict[str, Any] = {}

        def timed_out() -> None:
            outcome["timeout"] = True
            self._settle(batch, "timeout")

        deadline = loop.call_later(plan.shadow_timeout_s, timed_out)

        def ended(done: asyncio.Future) -> None:
            deadline.cancel()
            candidate.release()
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
        outputs, times = done.result()
        seconds = (times.compute_input_ns + times.compute_infer_ns) / 1e9  # joined and run
        at = 0
        try:
            for copy in batch:
                count = len(copy.rows)
                candidate = softmax(outputs[0][at : at + count])
                if candidate.shape != copy.probabilities.shape:  # type: ignore[union-attr]
                    raise ValueError(
                        f"the candidate answered {list(candidate.shape)} for live's "
                        f"{list(copy.probabilities.shape)}"  # type: ignore[union-attr]
                    )
                copy.comparison.add(copy.probabilities, candidate, copy.live_s, seconds)  # type: ignore[arg-type]
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
    """Every model's shadow and comparisons, fed by the engine's calls (``Engine.call``)."""

    def __init__(self, manager: ModelManager, series: ShadowSeries) -> None:
        self.manager = manager
        self.series = series
        self.models: dict[str, ModelShadow] = {}
        self.comparisons: dict[tuple[str, int, int], Comparison] = {}

    def offer(self, pipeline: ModelPipeline, graph: Graph, requests: list[Request]) -> None:
        """Shadow each of ``requests``, about to be queued on ``pipeline``, when its model tries a
        candidate, they go to the live version's classifier and the shadow share picks it."""
        model = self.manager.models.get(pipeline.name)
        if graph != "classifier" or model is None:
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
        for request in requests:
            if plan.shadow_percent < 100 and random.random() * 100 >= plan.shadow_percent:
                continue
            shadow.offer(request, pipeline, candidate, comparison, plan)

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
        return {
            "model": model.name,
            "live_version": model.live_version(),
            "candidate_version": plan.candidate_version,
            "candidate_ready": plan.candidate_version in model.ready_versions(),
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
