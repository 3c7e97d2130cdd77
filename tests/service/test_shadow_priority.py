"""The shadow gives way: it runs only while neither version has work waiting, and under load it is shed.

Deterministic: both versions are real dynamic batchers whose model runs wait on gates this test opens,
one batch at a time, so what may run at each step is decided by the test, never by the CPU's speed.
"""

from __future__ import annotations

import asyncio
import re
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from service.contract.candidate_plan import CandidatePlan, candidate_plan
from service.contract.candidates import in_canary
from service.contract.model_config import ModelConfig, ModelConfigError
from service.contract.table import ShadowCopy
from service.engine.batcher import DynamicBatcher
from service.engine.comparison import Comparison
from service.engine.request import Request
from service.engine.shadow import ModelShadow, Shadows
from service.observability.metrics import Metrics


class Gated:
    """A one-instance model: each run waits for one ``open()``; it answers logits from the rows."""

    def __init__(self) -> None:
        self.allowed = threading.Semaphore(0)
        self.started = 0
        self.finished = 0

    def __call__(self, images: np.ndarray) -> tuple[np.ndarray]:
        self.started += 1
        assert self.allowed.acquire(timeout=30), "never opened"
        self.finished += 1
        return (np.repeat(images.reshape(len(images), -1)[:, :1], 3, axis=1),)

    def open(self) -> None:
        self.allowed.release()


class Live:
    """A live request and whether its caller has been answered."""

    def __init__(self, rows: np.ndarray) -> None:
        self.answered = False
        self.request = Request(rows, self._reply)

    def _reply(self, request: Request, outputs: object, error: Exception | None) -> None:
        assert error is None, error
        self.answered = True


def ungated(images: np.ndarray) -> tuple[np.ndarray]:
    return (np.repeat(images.reshape(len(images), -1)[:, :1], 3, axis=1),)


def version(
    number: int, model: Gated, metrics: Metrics, batch: int, timed: object = None
) -> SimpleNamespace:
    """What the shadow uses of a version: its classifier batcher (batches of up to ``batch``), its
    runtime (``timed``: what the shadow's paired timing runs, when not ``model``), its lease."""
    batcher = DynamicBatcher(
        "classifier",
        model,
        max_batch_size=batch,
        max_queue_delay_s=0.0,
        max_queue_size=64,
        timeout_s=30.0,
        retry_after_s=1,
        metrics=metrics,
        model="m",
    )
    return SimpleNamespace(
        version=number,
        classifier=batcher,
        runtime=SimpleNamespace(classify_with=lambda instance: timed or model),
        serving=SimpleNamespace(max_batch_size=4),  # the shadow's batches: up to 4 on both
        view=SimpleNamespace(preprocessing_key=11, row_shape=(1, 1, 1)),
        accepting=True,
        hold=lambda: None,
        release=lambda: None,
    )


def live_and_candidate() -> tuple[
    Gated, Gated, SimpleNamespace, SimpleNamespace, Comparison, ModelShadow
]:
    """Version 1 live and version 2 its candidate, each on a gated model of its own (the live one
    runs one image a batch, so that two requests wait while one runs; the candidate up to four), and
    the comparison and shadow between them; no batcher started."""
    metrics = Metrics()
    live_model, candidate_model = Gated(), Gated()
    # the shadow times the live version on its copies too: that run is not gated (the live batches
    # this test steps through are)
    live = version(1, live_model, metrics, batch=1, timed=ungated)
    candidate = version(2, candidate_model, metrics, batch=4)
    comparison = Comparison("m", 1, 2, metrics.shadow)
    return live_model, candidate_model, live, candidate, comparison, ModelShadow("m")


async def until(condition, what: str) -> None:
    """Let the event loop and the model threads move until ``condition()``; bounded, not timed."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_under_load_the_shadow_is_shed_first_and_no_live_request_waits_behind_it():
    async def scenario() -> None:
        live_model, candidate_model, live, candidate, comparison, shadow = live_and_candidate()
        live.classifier.start()
        candidate.classifier.start()
        plan = CandidatePlan(candidate_version=2, shadow_percent=100, shadow_queue_size=2)

        def request(value: float) -> Live:
            call = Live(np.full((1, 1, 1, 1), value, dtype=np.float32))
            # as the engine does: offered to the shadow, then queued on the live version
            shadow.offer(call.request, None, live, candidate, comparison, plan)  # type: ignore[arg-type]
            live.classifier.enqueue([call.request])
            return call

        # overload: three live requests, one running and two waiting; the third copy is shed
        calls = [request(value) for value in (1.0, 2.0, 3.0)]
        await until(lambda: live_model.started == 1, "the first live batch running")
        assert comparison.outcomes["shed"] == 1 and shadow.pending == 2
        # each live batch that ends hands the instance to the next live one, never to the shadow
        live_model.open()
        await until(lambda: calls[0].answered, "the first live answer")
        await until(lambda: live_model.started == 2, "the waiting live work running")
        await asyncio.sleep(0.05)  # what could start now has had its turn
        assert candidate_model.started == 0 and not shadow.running
        live_model.open()
        await until(lambda: calls[1].answered, "the second live answer")
        await until(lambda: live_model.started == 3, "the last live request running")
        await asyncio.sleep(0.05)
        assert not shadow.running, "the shadow ran while live work waited or ran"
        assert candidate_model.started == 0
        live_model.open()
        await until(lambda: calls[2].answered, "the third live answer")
        # the model is idle: the two copies the queue held run now, as one batch
        await until(lambda: candidate_model.started == 1, "the shadow running once live is idle")
        # while the shadow runs (held), live requests are served at once, on their own instance
        late = request(4.0)
        live_model.open()
        await until(lambda: late.answered, "a live request answered while the shadow runs")
        assert candidate_model.finished == 0 and shadow.running
        assert comparison.outcomes["shed"] == 2  # the running copies still fill the queue
        candidate_model.open()
        await until(lambda: comparison.outcomes["compared"] == 2, "the held copies compared")
        # idle again: a new request's copy runs once its live answer is in
        last = request(5.0)
        live_model.open()
        await until(lambda: last.answered, "the last live answer")
        await until(lambda: candidate_model.started == 2, "the last copy running")
        candidate_model.open()
        await until(lambda: comparison.outcomes["compared"] == 3, "the last copy compared")
        assert comparison.images == 3 and comparison.agreements == 3
        assert dict(comparison.outcomes) == {"compared": 3, "shed": 2}
        shadow.close()
        for batcher in (live.classifier, candidate.classifier):
            await batcher.stop(5)

    asyncio.run(scenario())


def test_a_call_whose_mark_does_not_fit_the_candidate_is_counted_incompatible_never_run():
    """The engine checks the front end's mark against the versions it has now: rows the candidate
    does not take (a mark from an older table, or rows of another shape) are never run on it."""
    metrics = Metrics()
    live_model, candidate_model = Gated(), Gated()
    live = version(1, live_model, metrics, batch=4, timed=ungated)
    live.name = "m"
    candidate = version(2, candidate_model, metrics, batch=4)
    candidate.view = SimpleNamespace(preprocessing_key="other rows", row_shape=(1, 2, 2))
    plan = CandidatePlan(candidate_version=2, shadow_percent=100)
    model = SimpleNamespace(
        name="m",
        plan=plan,
        live_version=lambda: 1,
        pipeline=lambda number: candidate,
        comparison=lambda: ("own", "the candidate runs on its own rows"),
    )
    shadows = Shadows(SimpleNamespace(models={"m": model}), metrics.shadow)  # type: ignore[arg-type]
    rows = np.ones((1, 1, 1, 1), dtype=np.float32)
    marks = {
        "same": ShadowCopy("same"),  # the live rows: the candidate takes others
        "wrong shape": ShadowCopy("own", np.ones((1, 1, 3, 3), dtype=np.float32)),
        "incompatible": ShadowCopy("incompatible"),
        "fits": ShadowCopy("own", np.ones((1, 1, 2, 2), dtype=np.float32)),
        "not drawn": None,
    }
    requests = []
    for mark in marks.values():
        request = Request(rows, lambda *_: None)
        request.shadow = mark
        requests.append(request)
    shadows.offer(live, requests)  # type: ignore[arg-type]
    comparison = shadows.comparisons[("m", 1, 2)]
    assert dict(comparison.outcomes) == {"incompatible": 3}
    assert shadows.models["m"].pending == 1  # only "fits" waits for its live answer
    assert candidate_model.started == 0
    shadows.close()


def test_a_client_key_decides_the_canary_alone():
    keys = [f"user-{i}" for i in range(2000)]
    first = [in_canary(30, key) for key in keys]
    assert first == [in_canary(30, key) for key in keys]
    assert 600 - 4.5 * (2000 * 0.3 * 0.7) ** 0.5 <= sum(first) <= 600 + 4.5 * (420**0.5)
    assert not any(in_canary(0, key) for key in keys) and all(in_canary(100, k) for k in keys)
    # a larger share keeps every key the smaller one sent to the candidate
    assert all(in_canary(60, key) for key, chosen in zip(keys, first, strict=True) if chosen)


def test_the_parameters_are_read_and_refused_by_name():
    config = ModelConfig()
    for key, value in {
        "vitserve_candidate_version": "3",
        "vitserve_shadow_percent": "25",
        "vitserve_canary_percent": "5.5",
        "vitserve_shadow_queue_size": "8",
        "vitserve_shadow_timeout_ms": "250",
        "other_backend_setting": "kept",  # not vitserve's: Triton's backends may have their own
    }.items():
        config.parameters[key].string_value = value
    assert candidate_plan(config) == CandidatePlan(None, 3, 25.0, 5.5, 8, 0.25)
    for key, value, message in (
        ("vitserve_candidate_version", "two", "vitserve_candidate_version must be an integer"),
        ("vitserve_canary_percent", "-1", "vitserve_canary_percent must lie in 0..100, got -1"),
        ("vitserve_live_version", "3", "must differ from vitserve_live_version (3)"),
        ("vitserve_shadow_queue_size", "0", "vitserve_shadow_queue_size must be 1 or more"),
        ("vitserve_promote_min_requests", "500", "automatic promotion needs all of"),
    ):
        wrong = ModelConfig()
        wrong.CopyFrom(config)
        wrong.parameters[key].string_value = value
        with pytest.raises(ModelConfigError, match=re.escape(message)):
            candidate_plan(wrong)


def test_every_early_shadow_batch_is_timed_then_one_in_four():
    """The live version runs a shadow batch again only to time it: all of the first 200 batches,
    then one in 4, so that a long trial does not double the shadow's cost."""
    comparison = Comparison("m", 1, 2, Metrics().shadow)
    timed = []
    for batch in range(1000):
        if comparison.time_next():
            timed.append(batch)
            comparison.timed(0.002, 0.002)
    assert timed[:200] == list(range(200))
    assert timed[200:] == list(range(203, 1000, 4))
    assert comparison.report()["model_ms"]["pairs"] == 200 + 200
