"""What callers, operators and the shutdown rely on from the batcher beyond batching itself: refusals
before start and while closing, a full batch not waiting, the metrics per graph, the log of a failed
batch, a timed-out request leaving the queue, and a drain that runs out of time; and (the last block)
the watchdog's log and answer, fail_all, stop's threads, flush, preferred sizes without idle dispatch,
the statistics and tracing spans of a batch, a client that hangs up and a non-finite output.

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
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.engine import batch_runs as batcher_module
from service.engine.batch_runs import finite_rows
from service.engine.batcher import DynamicBatcher
from service.engine.statistics import ModelStatistics
from service.errors import ClientDisconnected, InferenceFailed, ServiceUnavailable
from service.observability import tracing
from service.observability.metrics import Metrics
from tests.support import HoldFirstCall, submit


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


def make(run: Model | list, graph: str = "classifier", **options) -> DynamicBatcher:
    values = {
        "max_batch_size": 4,
        "max_queue_delay_s": 0.0,
        "max_queue_size": 16,
        "timeout_s": 10.0,
        "retry_after_s": 7,
        "metrics": Metrics(),
    }
    values.update(options)
    return DynamicBatcher(graph, run, **values)


def rows(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32).reshape(-1, 1, 1, 1)


async def held_batch(
    images: np.ndarray, settle_s: float = 0.1, **options
) -> tuple[Model, DynamicBatcher, asyncio.Task]:
    """A started batcher (``make``'s options) whose model holds its first batch, ``images``, at the
    gate: the batch is taken and running once this returns."""
    model = Model()
    model.gate.clear()
    b = make(model, **options)
    b.start()
    running = asyncio.create_task(submit(b, images))
    await asyncio.sleep(settle_s)
    return model, b, running


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
            await submit(b, rows(1))
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
            await submit(b, rows(1))
        return b, refused.value

    b, error = asyncio.run(scenario())
    assert (error.status_code, error.code) == (503, "shutting_down")
    assert error.message == "this model version is shutting down and accepts no new work; retry"
    assert error.headers["Retry-After"] == "7"
    reason = {"graph": "classifier", "reason": "shutting_down"}
    assert sample(b, "vitserve_rejected_requests_total", **reason) == 1.0


def test_a_full_batch_runs_at_once_without_waiting_for_the_delay():
    async def scenario():
        b = make(Model(), max_batch_size=2, max_queue_delay_s=30.0)
        b.start()
        started = time.perf_counter()
        answer = await asyncio.wait_for(submit(b, rows(1, 2)), 10)
        waited = time.perf_counter() - started
        await b.stop(5)
        return answer, waited

    answer, waited = asyncio.run(scenario())
    assert answer[0].tolist() == [1.0, 2.0]
    assert waited < 5  # a full batch of 2 does not wait for the 30 s delay


def test_batches_run_on_the_graphs_own_worker_thread():
    async def scenario():
        model = Model()
        b = make(model, graph="attention")
        b.start()
        await asyncio.gather(*(submit(b, rows(i)) for i in range(6)))
        await b.stop(5)
        return model

    model = asyncio.run(scenario())
    assert model.threads and all(name.startswith("vitserve-attention") for name in model.threads)


def test_metrics_are_recorded_under_the_graphs_label():
    async def scenario():
        b = make(Model(), graph="attention", max_batch_size=3)
        b.start()
        await asyncio.gather(submit(b, rows(1, 2)), submit(b, rows(3)))
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

        first = asyncio.create_task(submit(b, rows(1, 2)))  # taken at once, held
        await settle_and_read()
        rest = asyncio.create_task(submit(b, rows(3, 4, 5)))  # waits behind it
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
        running = asyncio.create_task(submit(b, rows(1, 2)))  # taken, held; times out at 2 s
        await asyncio.sleep(0.1)
        early = asyncio.create_task(submit(b, rows(3)))  # queued; times out at 2.1 s
        await asyncio.sleep(0.5)
        late = asyncio.create_task(submit(b, rows(4)))  # queued; would time out at 2.6 s
        await asyncio.wait({running, early})  # both timed out (about 2.1 s), `late` has not
        model.gates[0].set()
        results = await asyncio.gather(running, early, late, return_exceptions=True)
        await b.stop(5)
        return results

    running, early, late = asyncio.run(scenario())
    assert isinstance(running, ServiceUnavailable) and isinstance(early, ServiceUnavailable)
    assert late[0].tolist() == [4.0]  # still queued, and served


def test_a_failed_batch_is_logged_with_its_graph_request_ids_and_cause(caplog):
    async def scenario():
        b = make(Model(short=True), graph="attention", max_batch_size=2, max_queue_delay_s=1.0)
        b.start()
        results = await asyncio.gather(
            submit(b, rows(1), request_id="req-b"),
            submit(b, rows(2), request_id="req-a"),
            return_exceptions=True,
        )
        await b.stop(5)
        return b, results

    with caplog.at_level(logging.ERROR, logger="vitserve"):
        b, results = asyncio.run(scenario())
    assert all(isinstance(result, InferenceFailed) for result in results), results
    assert results[0].message == (
        "the model failed on the batch holding this request (RuntimeError); "
        "quote the request id when reporting it"
    )
    (record,) = [r for r in caplog.records if r.name == "vitserve"]
    assert record.getMessage() == "attention batch of 2 images failed (requests req-a, req-b)"
    assert record.exc_info is not None
    assert "the model returned 1 rows for a batch of 2" in str(record.exc_info[1])
    assert sample(b, "vitserve_inference_failures_total", graph="attention") == 1.0


def test_a_failed_batch_without_request_ids_logs_a_dash(caplog):
    async def scenario():
        b = make(Model(short=True), max_batch_size=2, max_queue_delay_s=1.0)
        b.start()
        await asyncio.gather(submit(b, rows(1)), submit(b, rows(2)), return_exceptions=True)
        await b.stop(5)

    with caplog.at_level(logging.ERROR, logger="vitserve"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if r.name == "vitserve"]
    assert record.getMessage() == "classifier batch of 2 images failed (requests -)"


def test_a_timed_out_request_leaves_the_queue_at_once_and_is_counted():
    async def scenario():
        model, b, running = await held_batch(
            rows(1, 2), max_batch_size=2, max_queue_size=4, timeout_s=0.3
        )
        with pytest.raises(ServiceUnavailable) as timed_out:
            await submit(b, rows(3, 4, 5, 6))  # fills the queue, then times out
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
        model, b, running = await held_batch(
            rows(1, 2), max_batch_size=2, max_queue_delay_s=30.0, timeout_s=20.0, settle_s=0.2
        )
        queued = [asyncio.create_task(submit(b, rows(i))) for i in (3, 4, 5)]
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
        assert result.message == "the service shut down before this request was answered"
        assert result.headers["Retry-After"] == "7"


def test_a_finished_instance_takes_the_next_due_batch_before_its_callers_are_answered():
    """Otherwise the model idles while the event loop answers (and, in a server, reads and decodes
    the next requests of) every caller of the batch that just ran."""

    async def scenario():
        model = Model(held=1)
        b = make(model, max_batch_size=2)
        b.start()

        async def first_caller() -> float | None:
            await submit(b, rows(1, 2))  # taken at once, held
            return sample(b, "vitserve_queue_depth", graph="classifier")  # as it is answered

        first = asyncio.create_task(first_caller())
        await asyncio.sleep(0.2)
        waiting = asyncio.create_task(submit(b, rows(3, 4)))  # a full batch, due, behind it
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
        b = make(
            [held_first, held_first],
            max_batch_size=8,
            preferred_batch_sizes=(2, 4),
            max_queue_delay_s=30.0,
        )
        b.start()
        held = asyncio.create_task(submit(b, rows(0)))  # all idle: runs at once, holds one instance
        await asyncio.sleep(0.1)
        seven = asyncio.create_task(submit(b, rows(1, 2, 3, 4, 5, 6, 7)))
        await asyncio.sleep(0.2)
        ran_before_the_eighth = list(model.batches)  # 4 of the 7; 3 wait for a preferred size
        one = await asyncio.wait_for(submit(b, rows(8)), 5)
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
    assert outputs[0].tolist() == [1, 2, 3, 4, 5, 6, 7] and one[0].tolist() == [8]


# Written for the survivors of the full mutation run of the batcher, 2026-11-27 (docs/testing.md):
# the watchdog's log and answer, fail_all's default code, stop's threads, flush without close,
# preferred sizes without idle dispatch, the statistics a batch records, the batch spans of tracing,
# a client that hangs up, a non-finite output, and the queue depth with an instance left idle.


def break_the_loop(b: DynamicBatcher) -> None:
    """The loop's next dispatch raises, as a bug in it would."""

    def broken(waiting: int) -> int:
        raise RuntimeError("a bug in the loop")

    b._batch_target = broken


def vitserve_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vitserve" and r.levelno >= 40]


@pytest.mark.parametrize(("model", "shown"), [("tiny-vit", "tiny-vit"), ("", "-")])
def test_the_watchdog_logs_the_dead_loop_and_answers_a_retryable_503(caplog, model, shown):
    async def scenario():
        b = make(Model(), graph="attention", model=model)
        break_the_loop(b)
        b.start()
        with pytest.raises(ServiceUnavailable) as failed:
            await asyncio.wait_for(submit(b, rows(1)), 5)
        return b, failed.value

    with caplog.at_level(logging.ERROR, logger="vitserve"):
        b, error = asyncio.run(scenario())
    assert vitserve_errors(caplog) == [
        f"the attention batcher of {shown} stopped: RuntimeError('a bug in the loop')"
    ]
    assert isinstance(b.failure, RuntimeError) and not b.healthy
    assert (error.status_code, error.code) == (503, "batcher_failed")
    assert error.message == "the batcher stopped; retry on another instance"
    assert error.headers["Retry-After"] == "7"


def test_a_loop_that_ends_or_is_cancelled_is_no_failure(caplog):
    """A drained loop returns, and one out of drain time is cancelled: neither is a dead loop."""

    async def scenario():
        loop = asyncio.get_running_loop()
        callback_errors: list[dict] = []
        loop.set_exception_handler(lambda _, context: callback_errors.append(context))
        drained = make(Model())
        drained.start()
        await submit(drained, rows(1))
        assert await drained.stop(5) == 0
        model = Model()
        model.gate.clear()
        cancelled = make(model)
        cancelled.start()
        held = asyncio.create_task(submit(cancelled, rows(1)))
        await asyncio.sleep(0.1)
        assert await cancelled.stop(0.1) == 1
        await asyncio.gather(held, return_exceptions=True)
        for _ in range(3):  # the watchdog runs as a done callback of the cancelled loop task
            await asyncio.sleep(0)
        model.gate.set()
        return drained, cancelled, callback_errors

    with caplog.at_level(logging.ERROR):
        drained, cancelled, callback_errors = asyncio.run(scenario())
    assert drained.failure is None and cancelled.failure is None
    assert vitserve_errors(caplog) == [] and callback_errors == []


def test_fail_all_answers_503_shutting_down_by_default_and_skips_abandoned_images():
    """The model manager fails a version's batchers with the default code."""

    async def scenario():
        model, b, running = await held_batch(rows(1, 2), max_batch_size=2)
        queued = asyncio.create_task(submit(b, rows(3)))
        gone = asyncio.create_task(submit(b, rows(4)))
        await asyncio.sleep(0.05)
        gone.cancel()  # its client went away: its image is abandoned, nobody to answer
        await asyncio.gather(gone, return_exceptions=True)
        failed = b.fail_all("the version was unloaded")
        results = await asyncio.gather(running, queued, return_exceptions=True)
        model.gate.set()
        await b.stop(5)
        return failed, results

    failed, results = asyncio.run(scenario())
    assert failed == 3  # two running, one queued; not the abandoned one
    for result in results:
        assert isinstance(result, ServiceUnavailable), result
        assert (result.code, result.message) == ("shutting_down", "the version was unloaded")
        assert result.headers["Retry-After"] == "7"


def test_stop_joins_the_worker_threads_and_works_before_start():
    async def scenario():
        b = make(Model(), graph="joined")
        b.start()
        await submit(b, rows(1, 2))
        failed = await b.stop(5)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("vitserve-joined")]
        never_started = make(Model(), graph="unstarted")
        return failed, alive, await never_started.stop(1)

    failed, alive, unstarted_failed = asyncio.run(scenario())
    assert failed == 0 and alive == []  # stop waited for them (nothing was left to fail)
    assert unstarted_failed == 0


def test_flush_runs_what_is_queued_without_the_delay_and_keeps_accepting():
    """SIGTERM flushes before it closes: queued images run now, and new work is still taken."""

    async def scenario():
        b = make(Model(), max_queue_delay_s=30.0, idle_dispatch=False)
        b.start()
        queued = asyncio.create_task(submit(b, rows(1)))
        await asyncio.sleep(0.1)
        depth = sample(b, "vitserve_queue_depth", graph="classifier")
        b.flush()
        first = await asyncio.wait_for(queued, 5)
        later = await asyncio.wait_for(submit(b, rows(2)), 5)
        accepting = b.accepting
        await b.stop(5)
        return depth, first, later, accepting

    depth, first, later, accepting = asyncio.run(scenario())
    assert depth == 1.0  # it waited for the delay until the flush
    assert float(first[0][0]) == 1.0 and float(later[0][0]) == 2.0 and accepting


def test_without_idle_dispatch_a_full_or_largest_preferred_batch_runs_at_once_others_wait():
    """Preferred sizes (2, 3, 5), max 8, one instance, idle dispatch off, a 1 s delay: 4 images wait
    the delay and run as the largest preferred size that fits (3) and the rest; 5 run at once; 1
    waits; max_batch_size images with no preferred size run at once; a preferred size of 1 means
    every image runs at once."""

    async def timed(b: DynamicBatcher, values: tuple[float, ...]) -> tuple[float, list[float]]:
        started = time.perf_counter()
        answer = await asyncio.wait_for(submit(b, rows(*values)), 10)
        return time.perf_counter() - started, answer[0].tolist()

    async def scenario():
        model = Model()
        options = {"max_batch_size": 8, "max_queue_delay_s": 1.0, "idle_dispatch": False}
        b = make(model, preferred_batch_sizes=(5, 3, 2, 9, 0), **options)
        b.start()
        four = await timed(b, (1, 2, 3, 4))
        five = await timed(b, (1, 2, 3, 4, 5))
        one = await timed(b, (7,))
        await b.stop(5)
        full_model = Model()
        full = make(full_model, max_batch_size=2, max_queue_delay_s=30.0, idle_dispatch=False)
        full.start()
        two = await timed(full, (1, 2))
        await full.stop(5)
        top_model = Model()
        top = make(
            top_model,
            max_batch_size=4,
            preferred_batch_sizes=(2, 4),
            max_queue_delay_s=30.0,  # what runs, runs because it is full
            idle_dispatch=False,
        )
        top.start()
        at_max = await timed(top, (1, 2, 3, 4))
        await top.stop(5)
        lone_model = Model()
        lone = make(lone_model, preferred_batch_sizes=(1,), max_queue_delay_s=30.0)
        lone.idle_dispatch = False
        lone.start()
        single = await timed(lone, (6,))
        await lone.stop(5)
        return (
            model.batches,
            four,
            five,
            one,
            full_model.batches,
            two,
            top_model.batches,
            at_max,
            single,
        )

    batches, four, five, one, full_batches, two, top_batches, at_max, single = asyncio.run(
        scenario()
    )
    assert batches == [3, 1, 5, 1]
    assert four[1] == [1, 2, 3, 4] and four[0] >= 0.99  # not full: waited the delay
    assert five[1] == [1, 2, 3, 4, 5] and five[0] < 0.8  # the largest preferred size: at once
    assert one[1] == [7] and one[0] >= 0.99
    assert full_batches == [2] and two == (two[0], [1, 2]) and two[0] < 5
    assert top_batches == [4] and at_max[0] < 5  # a preferred size equal to the max is kept
    assert single[1] == [6] and single[0] < 5


def test_a_batch_records_its_stacking_run_and_split_times_in_the_given_statistics():
    """Triton's statistics: a batch of two whose model run takes 50 ms records about 50 ms of
    compute_infer, and far less for stacking its rows (compute_input) and splitting them."""

    def slow(images: np.ndarray) -> tuple[np.ndarray]:
        time.sleep(0.05)
        return (images.reshape(len(images), -1).sum(axis=1),)

    async def scenario():
        statistics = ModelStatistics()
        b = make(slow, statistics=statistics)
        b.start()
        answer = await submit(b, rows(1, 2))
        await b.stop(5)
        split = make(slow, statistics=split_statistics, max_batch_size=1)
        split.start()
        await submit(split, rows(1, 2))
        await split.stop(5)
        return b, statistics, answer

    split_statistics = ModelStatistics()
    b, statistics, answer = asyncio.run(scenario())
    assert b.statistics is statistics and answer[0].tolist() == [1.0, 2.0]
    report = statistics.as_dict("m", "1")
    assert (report["execution_count"], report["inference_count"]) == (1, 2)
    (batch,) = report["batch_stats"]
    assert batch["batch_size"] == 2
    infer = batch["compute_infer"]["ns"]
    assert 50_000_000 <= infer < 5_000_000_000
    assert 0 <= batch["compute_input"]["ns"] < 50_000_000
    assert 0 <= batch["compute_output"]["ns"] < 50_000_000
    request = report["inference_stats"]
    assert request["compute_infer"] == {"count": 1, "ns": infer}  # the request's one batch
    assert 0 <= request["queue"]["ns"] < 50_000_000  # an idle instance took it at once
    # a request split across two batches of one: its compute time is both batches'
    split = split_statistics.as_dict("m", "1")
    (lone,) = split["batch_stats"]
    assert (lone["batch_size"], lone["compute_infer"]["count"]) == (1, 2)
    assert split["inference_stats"]["compute_infer"] == {
        "count": 1,
        "ns": lone["compute_infer"]["ns"],
    }
    assert lone["compute_infer"]["ns"] >= 100_000_000


def test_batch_spans_name_model_graph_instance_link_their_requests_and_record_failures(
    monkeypatch,
):
    """With tracing on, each batch (on an instance's thread or inline on the loop) ends a span that
    names its model, graph and instance, links the spans of its requests, and fails with the
    model's error; each request's queue span ends when its batch starts."""
    monkeypatch.setattr(batcher_module, "INLINE_RUN_MAX_S", 1.0)  # the second lone run: inline

    on_the_loop: list[tuple[list[float], bool]] = []  # each run's rows, and whether it was inline

    def summing(images: np.ndarray) -> tuple[np.ndarray]:
        on_the_loop.append((images.ravel().tolist(), threading.current_thread() is loop_thread))
        if (images == -1).any():
            raise ValueError("poisoned row")
        return (images.reshape(len(images), -1).sum(axis=1),)

    held = HoldFirstCall(summing)
    loop_thread = threading.current_thread()  # asyncio.run runs the loop here

    async def scenario():
        b = make(summing, graph="attention", model="tiny-vit", max_batch_size=4)
        pair = make([held, held], graph="attention", model="tiny-vit", max_batch_size=4)

        async def request(batcher: DynamicBatcher, name: str, *values: float):
            with tracing.span(name):
                return await submit(batcher, rows(*values))

        b.start()
        await request(b, "thread", 1)  # the first lone run is timed on the thread
        await request(b, "inline", 2)
        with pytest.raises(InferenceFailed) as inline_failed:
            await request(b, "inline-fails", -1)
        await asyncio.gather(request(b, "batch-a", 3), request(b, "batch-b", 4))
        b.max_batch_size = 1  # two lone images at once: the first one runs on the thread
        results = await asyncio.gather(
            request(b, "thread-fails", -1), request(b, "after", 5), return_exceptions=True
        )
        await b.stop(5)
        pair.start()
        first = asyncio.create_task(request(pair, "instance-1", 6))  # held on one instance
        await asyncio.sleep(0.1)
        await request(pair, "instance-0", 7)  # the other instance takes it
        held.release.set()
        await first
        await pair.stop(5)
        return inline_failed.value, results

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.activate(provider)
    try:
        inline_failed, results = asyncio.run(scenario())
    finally:
        tracing.activate(None)
    assert "(ValueError)" in inline_failed.message  # the model's error, inline as on the thread
    assert isinstance(results[0], InferenceFailed) and "(ValueError)" in results[0].message
    assert float(results[1][0][0]) == 5.0
    # a lone image runs inline once a lone run was fast, and only when nothing else is queued or
    # running: not the first (untimed), not a batch of two, not one with a partner still queued
    assert on_the_loop[:6] == [
        ([1.0], False),
        ([2.0], True),
        ([-1.0], True),
        ([3.0, 4.0], False),
        ([-1.0], False),
        ([5.0], True),
    ]
    spans = exporter.get_finished_spans()
    names = {s.context.span_id: s.name for s in spans if s.name not in ("vitserve.batch",)}
    queues = [s for s in spans if s.name == "vitserve.queue"]
    assert len(queues) == 9  # one per request, every one ended
    assert all(span.attributes["vitserve.images"] == 1 for span in queues)
    batches = [s for s in spans if s.name == "vitserve.batch"]
    by_requests = {
        tuple(sorted(names[link.context.span_id] for link in s.links)): s for s in batches
    }
    assert sorted(by_requests) == [
        ("after",),
        ("batch-a", "batch-b"),
        ("inline",),
        ("inline-fails",),
        ("instance-0",),
        ("instance-1",),
        ("thread",),
        ("thread-fails",),
    ]
    for requests, span in by_requests.items():
        assert span.attributes["vitserve.model"] == "tiny-vit"
        assert span.attributes["vitserve.graph"] == "attention"
        assert span.attributes["vitserve.requests"] == len(requests)
        expected = 1 if requests == ("instance-1",) else 0
        assert span.attributes["vitserve.instance"] == expected, requests
        if requests[0].endswith("-fails"):
            assert span.status.status_code == trace.StatusCode.ERROR, requests
            assert span.status.description == "ValueError"
            assert [event.name for event in span.events] == ["exception"]
        else:
            assert span.status.status_code == trace.StatusCode.UNSET, requests


def test_an_image_not_yet_due_runs_when_its_delay_ends_without_spinning():
    """With idle dispatch off, a lone image runs when its 0.4 s delay is up (not later), and the
    loop sleeps meanwhile rather than polling: its thread spends next to no CPU time waiting."""

    async def scenario():
        b = make(
            Model(),
            model="tiny-vit",
            graph="attention",
            max_queue_delay_s=0.4,
            statistics=statistics,
        )
        b.idle_dispatch = False
        b.start()
        names = {task.get_name() for task in asyncio.all_tasks()}
        started, cpu = time.perf_counter(), time.thread_time()
        answer = await asyncio.wait_for(submit(b, rows(3)), 5)
        waited, spent = time.perf_counter() - started, time.thread_time() - cpu
        await b.stop(5)
        return names, answer, waited, spent

    statistics = ModelStatistics()
    names, answer, waited, spent = asyncio.run(scenario())
    queued_ns = statistics.as_dict("m", "1")["inference_stats"]["queue"]["ns"]
    assert 390_000_000 <= queued_ns <= waited * 1e9  # its wait in the queue, in nanoseconds
    assert "batcher-tiny-vit-attention" in names  # the loop's task, named for debugging
    assert float(answer[0][0]) == 3.0
    assert 0.39 <= waited < 0.9, waited
    assert spent < 0.1, spent


def test_the_queue_depth_gauge_counts_what_is_left_when_an_instance_stays_idle():
    """Two instances: a batch taken while the other instance is idle leaves the gauge at what is
    still queued (nothing, or the one image of three that waits for the delay)."""

    async def scenario():
        model = Model()
        idle = make([model, model], max_batch_size=2)
        idle.start()
        await submit(idle, rows(1, 2))  # one batch, on one instance
        emptied = sample(idle, "vitserve_queue_depth", graph="classifier")
        await idle.stop(5)
        waiting = make(
            [model, model], max_batch_size=2, max_queue_delay_s=30.0, idle_dispatch=False
        )
        waiting.start()
        three = asyncio.create_task(submit(waiting, rows(3, 4, 5)))  # two run: full; one waits
        await asyncio.sleep(0.2)
        left = sample(waiting, "vitserve_queue_depth", graph="classifier")
        await waiting.stop(5)  # runs the last one now
        return emptied, left, await three

    emptied, left, three = asyncio.run(scenario())
    assert (emptied, left) == (0.0, 1.0)
    assert three[0].tolist() == [3.0, 4.0, 5.0]


def test_a_client_that_goes_away_gets_client_disconnected_and_its_images_never_run():
    async def scenario():
        model, b, running = await held_batch(rows(1), max_batch_size=1)
        gone = asyncio.get_running_loop().create_future()
        leaving = asyncio.create_task(submit(b, rows(2, 3), disconnected=gone))
        await asyncio.sleep(0.1)
        gone.set_result(None)  # the client hung up while its two images were queued
        with pytest.raises(ClientDisconnected) as disconnected:
            await asyncio.wait_for(leaving, 5)
        model.gate.set()
        await running
        await b.stop(5)
        return b, model, disconnected.value

    b, model, error = asyncio.run(scenario())
    assert error.status_code == 499
    assert error.message == "the client went away; 2 of 2 images were not run"
    assert sample(b, "vitserve_cancelled_images_total", graph="classifier") == 2.0
    assert model.batches == [1]  # only the first request's image ever ran


def test_a_client_gone_after_its_batch_started_fails_nobody_else_in_the_batch():
    """A request cancelled between its batch's start (on the loop) and the instance's thread taking
    the batch up lets its rows go; the batch keeps the rows it took and runs, and its other
    requests are answered (the rows were once read in the thread, found gone, and the whole batch
    failed with a 500 for every request in it)."""

    async def scenario():
        model = Model()
        b = make(model, max_batch_size=4, max_queue_delay_s=0.0)
        instance = next(iter(b._instances))
        thread_busy = threading.Event()
        instance.submit(lambda: thread_busy.wait(10))  # the thread takes the batch up only later
        b.start()
        gone = asyncio.get_running_loop().create_future()
        leaving = asyncio.create_task(submit(b, rows(2, 3), disconnected=gone))
        staying = asyncio.create_task(submit(b, rows(5)))
        await asyncio.sleep(0.1)  # the batch of both has started: handed to the busy thread
        gone.set_result(None)
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(leaving, 5)
        thread_busy.set()
        answer = await asyncio.wait_for(staying, 5)
        await b.stop(5)
        return model, answer

    model, answer = asyncio.run(scenario())
    assert answer[0].tolist() == [5.0]
    assert model.batches == [3]  # one batch of the three images, the gone request's rows in it


def test_a_non_finite_output_fails_its_request_naming_model_and_graph():
    def infinite_for_nine(images: np.ndarray) -> tuple[np.ndarray]:
        sums = images.reshape(len(images), -1).sum(axis=1)
        return (np.where(sums == 9, np.inf, sums),)

    async def scenario():
        b = make(infinite_for_nine, graph="attention", model="tiny-vit", max_queue_delay_s=1.0)
        b.start()
        results = await asyncio.gather(
            submit(b, rows(9, 1)), submit(b, rows(2)), return_exceptions=True
        )
        await b.stop(5)
        return b, results

    b, (bad, good) = asyncio.run(scenario())
    assert isinstance(bad, InferenceFailed) and bad.code == "non_finite_output"
    assert bad.message.startswith(
        "model 'tiny-vit' (attention graph) produced NaN or Infinity for 1 of 2 images"
    )
    labels = {"model": "tiny-vit", "graph": "attention"}
    assert sample(b, "vitserve_non_finite_outputs_total", **labels) == 1.0
    assert float(good[0][0]) == 2.0  # its partner in the same batch is answered
    assert b.statistics.execution_count == 1


def test_the_finite_check_finds_the_rows_holding_nan_or_infinity_and_no_others():
    """``finite_rows`` gives None when every number is finite (finite numbers whose sum would
    overflow too), and otherwise which rows hold only finite numbers in every output."""
    huge = np.full((2, 4), 3e38, np.float32)  # each row sums past float32's largest number
    assert finite_rows([huge], 2) is None
    cancelling = np.zeros((3, 2), np.float32)
    cancelling[1] = (np.inf, -np.inf)
    assert finite_rows([cancelling], 3).tolist() == [True, False, True]
    nan_in_second = np.zeros((2, 5), np.float32)
    nan_in_second[0, 3] = np.nan
    assert finite_rows([np.zeros((2, 1), np.float32), nan_in_second], 2).tolist() == [False, True]
    assert finite_rows([np.ones((2, 3), np.float32), np.arange(2)], 2) is None


def test_a_batch_of_requests_from_two_turns_observes_every_image_s_wait():
    """Each image's wait goes into the queue-wait histogram once, whether or not the requests of
    its batch were queued in one turn (their waits are observed together, weighted)."""

    async def scenario():
        model = Model(held=1)  # the first batch holds the one instance
        b = make(model, max_batch_size=5)
        b.start()
        first = asyncio.create_task(submit(b, rows(0)))
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(submit(b, rows(1, 2)))]
        await asyncio.sleep(0.05)  # a later turn: another wait
        waiting.append(asyncio.create_task(submit(b, rows(3, 4, 5))))
        await asyncio.sleep(0.05)
        model.gates[0].set()
        await asyncio.gather(first, *waiting)
        await b.stop(5)
        return b, model

    b, model = asyncio.run(scenario())
    assert model.batches == [1, 5]
    assert sample(b, "vitserve_queue_wait_seconds_count") == 6.0  # one per image
    assert sample(b, "vitserve_queue_wait_seconds_bucket", le="+Inf") == 6.0


def test_observe_times_is_observe_repeated():
    """Against prometheus-client's own ``observe`` called once per image: the same buckets, count
    and sum, for waits on a bucket bound, between bounds and past the last."""
    from prometheus_client import CollectorRegistry, Histogram

    from service.observability.metrics import observe_times

    def histogram() -> tuple[CollectorRegistry, Histogram]:
        registry = CollectorRegistry()
        return registry, Histogram("wait", "w", ["g"], buckets=(0.1, 1.0), registry=registry)

    (reference_registry, reference), (registry, weighted) = histogram(), histogram()
    for amount, times in ((0.1, 3), (0.5, 1), (0.5, 4), (7.0, 2), (0.0, 5)):
        for _ in range(times):
            reference.labels("x").observe(amount)
        observe_times(weighted.labels("x"), amount, times)

    def samples(registry: CollectorRegistry) -> list:
        return [
            (s.name, s.labels, s.value)
            for f in registry.collect()
            for s in f.samples
            if not s.name.endswith("_created")
        ]

    assert samples(registry) == samples(reference_registry)
