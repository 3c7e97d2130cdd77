"""What callers, operators and the shutdown rely on from the batcher beyond batching itself: refusals
before start and while closing, a full batch not waiting, the metrics per graph, the log of a failed
batch, a timed-out request leaving the queue, and a drain that runs out of time.

Written to kill the mutants that `make mutation` found surviving in service/engine/batcher.py
(docs/testing.md); tests/service/test_batcher.py covers batching, ordering and the queue policy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest

from service.engine.batcher import DynamicBatcher
from service.errors import InferenceFailed, ServiceUnavailable
from service.observability.metrics import Metrics
from tests.support import HoldFirstCall


class Model:
    """Each row's sum; records the thread it ran on; can be held at a gate, or return too few rows."""

    def __init__(self, short: bool = False, held: int = 0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.gates = [threading.Event() for _ in range(held)]  # batch i waits for gates[i]
        self.threads: list[str] = []
        self.batches: list[int] = []
        self.short = short

    def __call__(self, images: np.ndarray) -> tuple[np.ndarray]:
        self.gate.wait(30)
        if len(self.batches) < len(self.gates):
            self.gates[len(self.batches)].wait(30)
        self.threads.append(threading.current_thread().name)
        self.batches.append(len(images))
        sums = images.reshape(len(images), -1).sum(axis=1)
        return (sums[:1] if self.short else sums,)


def make(model: Model, graph: str = "classifier", **options) -> DynamicBatcher:
    values = {
        "max_batch_size": 4,
        "max_queue_delay_s": 0.0,
        "max_queue_size": 16,
        "timeout_s": 10.0,
        "retry_after_s": 7,
        "metrics": Metrics(),
    }
    values.update(options)
    return DynamicBatcher(graph, model, **values)


def rows(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32).reshape(-1, 1, 1, 1)


def sample(b: DynamicBatcher, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` whose labels include ``labels``; None if there is none."""
    values = [
        s.value
        for family in b._metrics.registry.collect()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def test_before_start_a_request_is_503_not_ready_naming_the_graph():
    async def scenario():
        b = make(Model(), graph="attention")
        with pytest.raises(ServiceUnavailable) as refused:
            await b.submit(rows(1))
        return refused.value

    error = asyncio.run(scenario())
    assert (error.status_code, error.code) == (503, "not_ready")
    assert "the attention batcher" in error.message and "retry shortly" in error.message
    assert error.headers["Retry-After"] == "7"


def test_while_closing_new_work_is_503_and_counted_as_shutting_down():
    async def scenario():
        b = make(Model())
        b.start()
        await b.stop(5)
        with pytest.raises(ServiceUnavailable) as refused:
            await b.submit(rows(1))
        return b, refused.value

    b, error = asyncio.run(scenario())
    assert (error.status_code, error.code) == (503, "shutting_down")
    assert "shutting down and accepts no new work" in error.message
    assert error.headers["Retry-After"] == "7"
    reason = {"graph": "classifier", "reason": "shutting_down"}
    assert sample(b, "vitserve_rejected_requests_total", **reason) == 1.0


def test_a_full_batch_runs_at_once_without_waiting_for_the_delay():
    async def scenario():
        b = make(Model(), max_batch_size=2, max_queue_delay_s=30.0)
        b.start()
        started = time.perf_counter()
        answer = await asyncio.wait_for(b.submit(rows(1, 2)), 10)
        waited = time.perf_counter() - started
        await b.stop(5)
        return answer, waited

    answer, waited = asyncio.run(scenario())
    assert [float(row[0]) for row in answer] == [1.0, 2.0]
    assert waited < 5  # a full batch of 2 does not wait for the 30 s delay


def test_batches_run_on_the_graphs_own_worker_thread():
    async def scenario():
        model = Model()
        b = make(model, graph="attention")
        b.start()
        await asyncio.gather(*(b.submit(rows(i)) for i in range(6)))
        await b.stop(5)
        return model

    model = asyncio.run(scenario())
    assert model.threads and all(name.startswith("vitserve-attention") for name in model.threads)


def test_metrics_are_recorded_under_the_graphs_label():
    async def scenario():
        b = make(Model(), graph="attention", max_batch_size=3)
        b.start()
        await asyncio.gather(b.submit(rows(1, 2)), b.submit(rows(3)))
        depth_after = sample(b, "vitserve_queue_depth", graph="attention")
        await b.stop(5)
        return b, depth_after

    b, depth_after = asyncio.run(scenario())
    graph = {"graph": "attention"}
    assert depth_after == 0.0
    assert sample(b, "vitserve_batch_size_count", **graph) == 1.0  # one batch of three images
    assert sample(b, "vitserve_batch_size_sum", **graph) == 3.0
    assert sample(b, "vitserve_queue_wait_seconds_count", **graph) == 3.0  # one per image
    assert 0.0 <= sample(b, "vitserve_queue_wait_seconds_sum", **graph) < 5.0
    assert sample(b, "vitserve_compute_seconds_count", **graph) == 1.0
    assert 0.0 <= sample(b, "vitserve_compute_seconds_sum", **graph) < 5.0


def test_the_queue_depth_gauge_follows_the_queue():
    async def scenario():
        model = Model(held=2)
        b = make(model, max_batch_size=2)
        b.start()
        depth = []

        async def settle_and_read() -> None:
            await asyncio.sleep(0.2)
            depth.append(sample(b, "vitserve_queue_depth", graph="classifier"))

        first = asyncio.create_task(b.submit(rows(1, 2)))  # taken at once, held
        await settle_and_read()
        rest = asyncio.create_task(b.submit(rows(3, 4, 5)))  # waits behind it
        await settle_and_read()
        model.gates[0].set()  # the next batch takes two of the three and is held
        await settle_and_read()
        model.gates[1].set()
        await asyncio.gather(first, rest)
        await settle_and_read()
        await b.stop(5)
        return depth

    assert asyncio.run(scenario()) == [0.0, 3.0, 1.0, 0.0]


def test_a_timed_out_request_leaves_the_others_queued():
    async def scenario():
        model = Model(held=1)
        b = make(model, max_batch_size=2, timeout_s=2.0)
        b.start()
        running = asyncio.create_task(b.submit(rows(1, 2)))  # taken, held; times out at 2 s
        await asyncio.sleep(0.1)
        early = asyncio.create_task(b.submit(rows(3)))  # queued; times out at 2.1 s
        await asyncio.sleep(0.5)
        late = asyncio.create_task(b.submit(rows(4)))  # queued; would time out at 2.6 s
        await asyncio.wait({running, early})  # both timed out (about 2.1 s), `late` has not
        model.gates[0].set()
        results = await asyncio.gather(running, early, late, return_exceptions=True)
        await b.stop(5)
        return results

    running, early, late = asyncio.run(scenario())
    assert isinstance(running, ServiceUnavailable) and isinstance(early, ServiceUnavailable)
    assert [float(row[0]) for row in late] == [4.0]  # still queued, and served


def test_a_failed_batch_is_logged_with_its_graph_request_ids_and_cause(caplog):
    async def scenario():
        b = make(Model(short=True), graph="attention", max_batch_size=2, max_queue_delay_s=1.0)
        b.start()
        results = await asyncio.gather(
            b.submit(rows(1), request_id="req-b"),
            b.submit(rows(2), request_id="req-a"),
            return_exceptions=True,
        )
        await b.stop(5)
        return b, results

    with caplog.at_level(logging.ERROR, logger="vitserve"):
        b, results = asyncio.run(scenario())
    assert all(isinstance(result, InferenceFailed) for result in results), results
    assert "RuntimeError" in results[0].message and "request id" in results[0].message
    (record,) = [r for r in caplog.records if r.name == "vitserve"]
    assert record.getMessage() == "attention batch of 2 images failed (requests req-a, req-b)"
    assert record.exc_info is not None
    assert "the model returned 1 rows for a batch of 2" in str(record.exc_info[1])
    assert sample(b, "vitserve_inference_failures_total", graph="attention") == 1.0


def test_a_failed_batch_without_request_ids_logs_a_dash(caplog):
    async def scenario():
        b = make(Model(short=True), max_batch_size=2, max_queue_delay_s=1.0)
        b.start()
        await asyncio.gather(b.submit(rows(1)), b.submit(rows(2)), return_exceptions=True)
        await b.stop(5)

    with caplog.at_level(logging.ERROR, logger="vitserve"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if r.name == "vitserve"]
    assert record.getMessage() == "classifier batch of 2 images failed (requests -)"


def test_a_timed_out_request_leaves_the_queue_at_once_and_is_counted():
    async def scenario():
        model = Model()
        model.gate.clear()
        b = make(model, max_batch_size=2, max_queue_size=4, timeout_s=0.3)
        b.start()
        running = asyncio.create_task(b.submit(rows(1, 2)))  # taken, held at the gate
        await asyncio.sleep(0.1)
        with pytest.raises(ServiceUnavailable) as timed_out:
            await b.submit(rows(3, 4, 5, 6))  # fills the queue, then times out
        depth = sample(b, "vitserve_queue_depth", graph="classifier")
        b.admit(4)  # its four places are free again, while the model still holds its batch
        model.gate.set()
        await asyncio.gather(running, return_exceptions=True)
        await b.stop(5)
        return b, timed_out.value, depth

    b, error, depth = asyncio.run(scenario())
    assert error.code == "timeout"
    assert depth == 0.0
    reason = {"graph": "classifier", "reason": "timeout"}
    assert sample(b, "vitserve_rejected_requests_total", **reason) >= 1.0


def test_a_drain_out_of_time_fails_every_unanswered_image_with_503():
    async def scenario():
        model = Model()
        model.gate.clear()
        b = make(model, max_batch_size=2, max_queue_delay_s=30.0, timeout_s=20.0)
        b.start()
        running = asyncio.create_task(b.submit(rows(1, 2)))  # taken, held at the gate
        await asyncio.sleep(0.2)
        queued = [asyncio.create_task(b.submit(rows(i))) for i in (3, 4, 5)]
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        failed = await b.stop(0.2)
        stopped_in = time.perf_counter() - started
        results = await asyncio.gather(running, *queued, return_exceptions=True)
        model.gate.set()  # let the held worker thread end
        return failed, stopped_in, results

    failed, stopped_in, results = asyncio.run(scenario())
    assert failed == 5  # the two images of the held batch and the three queued ones
    assert stopped_in < 5  # it did not wait for the held batch (the gate holds it for 30 s)
    for result in results:  # every caller answered: 503 shutting_down, not left to time out
        assert isinstance(result, ServiceUnavailable), result
        assert (result.status_code, result.code) == (503, "shutting_down")
        assert "shut down before this request" in result.message


def test_a_finished_instance_takes_the_next_due_batch_before_its_callers_are_answered():
    """Otherwise the model idles while the event loop answers (and, in a server, reads and decodes
    the next requests of) every caller of the batch that just ran."""

    async def scenario():
        model = Model(held=1)
        b = make(model, max_batch_size=2)
        b.start()

        async def first_caller() -> float | None:
            await b.submit(rows(1, 2))  # taken at once, held
            return sample(b, "vitserve_queue_depth", graph="classifier")  # as it is answered

        first = asyncio.create_task(first_caller())
        await asyncio.sleep(0.2)
        waiting = asyncio.create_task(b.submit(rows(3, 4)))  # a full batch, due, behind it
        await asyncio.sleep(0.2)
        model.gates[0].set()
        depth_when_answered = await first
        await waiting
        await b.stop(5)
        return depth_when_answered

    assert asyncio.run(scenario()) == 0.0


def test_preferred_batch_sizes_run_the_largest_waiting_at_once_without_the_delay():
    """While an instance is busy, a batch waits for the delay unless a preferred size is waiting:
    then the largest preferred size runs at once on the idle instance."""

    async def scenario():
        model = Model()
        held_first = HoldFirstCall(model)
        b = DynamicBatcher(
            "classifier",
            [held_first, held_first],
            max_batch_size=8,
            preferred_batch_sizes=(2, 4),
            max_queue_delay_s=30.0,
            max_queue_size=16,
            timeout_s=10.0,
            retry_after_s=7,
            metrics=Metrics(),
        )
        b.start()
        held = asyncio.create_task(b.submit(rows(0)))  # all idle: runs at once, holds one instance
        await asyncio.sleep(0.1)
        seven = asyncio.create_task(b.submit(rows(1, 2, 3, 4, 5, 6, 7)))
        await asyncio.sleep(0.2)
        ran_before_the_eighth = list(model.batches)  # 4 of the 7; 3 wait for a preferred size
        one = await asyncio.wait_for(b.submit(rows(8)), 5)
        outputs = await asyncio.wait_for(seven, 5)
        held_first.release.set()
        await held
        started = time.perf_counter()
        failed = await b.stop(5)  # nothing left: the drain ends at once
        return (
            ran_before_the_eighth,
            model.batches,
            outputs,
            one,
            (failed, time.perf_counter() - started),
        )

    before, batches, outputs, one, (failed, stopped_in) = asyncio.run(scenario())
    assert failed == 0 and stopped_in < 1
    assert before == [4] and batches == [4, 4, 1]  # the held first batch ends last
    assert [float(o[0]) for o in outputs] == [1, 2, 3, 4, 5, 6, 7] and float(one[0][0]) == 8
