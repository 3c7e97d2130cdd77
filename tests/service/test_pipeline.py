"""service/engine/pipeline.py: one served version, its batchers, statistics and retirement.

Written against `make mutation`'s survivors in the module (docs/testing.md). The pipeline runs the tiny
model exported for the suite; its answers are compared with onnxruntime run here on the same file.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import onnxruntime as ort
import pytest

from service.contract.model_config import ServingConfig
from service.contract.model_repository import version_files
from service.engine.model_versions import model_config, serving_settings
from service.engine.pipeline import ModelPipeline
from service.engine.request import ClientGone, Request
from service.engine.runtime import Runtime
from service.engine.statistics import BatchTimes, ModelStatistics
from service.errors import NotFound, ServiceError
from service.observability.metrics import Metrics
from service.settings import Settings
from tests.support import MODEL_NAME, held, make_settings, run_on


@pytest.fixture(scope="module")
def loaded(model_repository):
    settings = make_settings(model_repository)
    serving = serving_settings(
        model_config(model_repository, MODEL_NAME), MODEL_NAME, settings.batching, settings.limits
    )
    runtime = Runtime.load(
        version_files(model_repository, MODEL_NAME, 1), settings.runtime, serving, settings.batching
    )
    return runtime, settings, serving


def pipeline_of(
    runtime: Runtime, serving: ServingConfig, settings: Settings, metrics: Metrics | None = None
) -> ModelPipeline:
    """The shipped model's pipeline on ``runtime``, with ``settings``' batching and limits."""
    return ModelPipeline(
        MODEL_NAME, runtime, serving, settings.batching, settings.limits, metrics or Metrics()
    )


def series(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def records(service_log) -> list[str]:
    return service_log.messages


def test_a_pipeline_runs_its_version_and_counts_its_requests(loaded, model_repository):
    runtime, settings, serving = loaded
    metrics = Metrics()
    rows = np.random.default_rng(0).standard_normal((2, 1, 28, 28)).astype(np.float32)
    session = ort.InferenceSession(str(model_repository / MODEL_NAME / "1" / "model.onnx"))
    expected = session.run(None, {session.get_inputs()[0].name: rows})[0]

    async def scenario() -> tuple[ModelPipeline, list]:
        pipeline = pipeline_of(runtime, serving, settings, metrics)
        pipeline.start()
        answers = await run_on(pipeline, "classifier", rows, "req-1")
        await pipeline.retire(5)
        return pipeline, answers

    pipeline, answers = asyncio.run(scenario())
    np.testing.assert_allclose(answers[0], expected, atol=1e-5)
    assert (pipeline.name, pipeline.version) == (MODEL_NAME, 1)
    assert pipeline.serving is serving
    assert pipeline.view.provider == runtime.provider == "CPUExecutionProvider"
    assert pipeline.view.attention and pipeline.attention is not None
    labels = {"model": MODEL_NAME, "version": "1"}
    assert series(metrics, "nv_inference_request_success", **labels) == 1
    assert series(metrics, "nv_inference_request_failure", **labels) == 0
    assert series(metrics, "nv_inference_count", **labels) == 2
    duration_us = series(metrics, "nv_inference_request_duration_us", **labels)
    assert 0 < duration_us < 60e6
    stats = pipeline.statistics.as_dict(MODEL_NAME, "1")["inference_stats"]
    assert stats["success"]["count"] == 1 and stats["fail"]["count"] == 0
    assert series(metrics, "vitserve_batch_size_count", model=MODEL_NAME, graph="classifier") == 1


def test_published_statistics_add_up_across_publishes_and_a_version_loaded_again():
    """The nv_inference_* series get each request once however often the engine publishes, and a
    version loaded again (new statistics, the same series) goes on from their last values."""
    metrics = Metrics()
    first = ModelStatistics(metrics.triton_series(MODEL_NAME, 1))
    first.record_batch(3, BatchTimes(1_000, 2_000, 3_000))
    first.record_outcome(True, 2_000)
    first.publish()
    first.publish()
    again = ModelStatistics(metrics.triton_series(MODEL_NAME, 1))
    again.record_outcome(False, 1_000)
    labels = {"model": MODEL_NAME, "version": "1"}
    assert series(metrics, "nv_inference_request_failure", **labels) == 0  # not yet published
    again.publish()
    assert series(metrics, "nv_inference_request_success", **labels) == 1
    assert series(metrics, "nv_inference_request_failure", **labels) == 1
    assert series(metrics, "nv_inference_count", **labels) == 3
    assert series(metrics, "nv_inference_exec_count", **labels) == 1
    assert series(metrics, "nv_inference_request_duration_us", **labels) == pytest.approx(3.0)


def failing(images: np.ndarray) -> list[np.ndarray]:
    """An instance's run that fails, as a model that cannot run a batch does."""
    raise RuntimeError("the model cannot run")


def test_a_failed_request_is_counted_failed_and_logged_with_its_id(loaded, records):
    runtime, settings, serving = loaded
    metrics = Metrics()

    async def scenario() -> ModelPipeline:
        pipeline = pipeline_of(runtime, serving, settings, metrics)
        for instance in pipeline.classifier._instances:
            instance.run = failing
        pipeline.start()
        with pytest.raises(ServiceError):
            await run_on(pipeline, "classifier", np.zeros((1, 1, 28, 28), np.float32), "req-9")
        await pipeline.retire(5)
        return pipeline

    pipeline = asyncio.run(scenario())
    labels = {"model": MODEL_NAME, "version": "1"}
    assert series(metrics, "nv_inference_request_failure", **labels) == 1
    assert series(metrics, "nv_inference_request_success", **labels) == 0
    stats = pipeline.statistics.as_dict(MODEL_NAME, "1")["inference_stats"]
    assert stats["fail"]["count"] == 1 and stats["success"]["count"] == 0
    assert any("batch of 1 images failed (requests req-9)" in m for m in records), records


def test_attention_runs_on_its_own_batcher(loaded):
    runtime, settings, serving = loaded
    metrics = Metrics()

    async def scenario() -> list:
        pipeline = pipeline_of(runtime, serving, settings, metrics)
        pipeline.start()
        answers = await run_on(pipeline, "attention", np.zeros((1, 1, 28, 28), np.float32))
        await pipeline.retire(5)
        return answers

    logits, maps = asyncio.run(scenario())  # every output, stacked over the one image
    assert logits.shape == (1, 10) and maps.ndim == 5  # [images, layers, heads, tokens, tokens]
    assert series(metrics, "vitserve_batch_size_count", model=MODEL_NAME, graph="attention") == 1


def test_a_client_gone_while_queued_ends_the_run_at_once(loaded):
    runtime, settings, serving = loaded
    slow = dataclasses.replace(serving, max_queue_delay_s=10.0)
    waiting = settings.model_copy(update={"idle_dispatch": False})  # an idle batcher waits too

    async def scenario() -> None:
        pipeline = pipeline_of(runtime, slow, waiting)
        pipeline.start()
        gone = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, gone.set_result, None)
        run = run_on(pipeline, "classifier", np.zeros((1, 1, 28, 28), np.float32), "r", gone)
        with pytest.raises((ClientGone, ServiceError)):
            await asyncio.wait_for(run, 5)  # the queue delay would hold it for 10 s
        await pipeline.retire(5)

    asyncio.run(scenario())


def test_a_version_without_an_attention_graph_refuses_attention(loaded):
    runtime, settings, serving = loaded
    pipeline = pipeline_of(dataclasses.replace(runtime, attention=None), serving, settings)
    assert pipeline.attention is None and not pipeline.view.attention
    assert pipeline.batchers == [pipeline.classifier]
    with pytest.raises(NotFound) as error:
        pipeline.batcher("attention")
    assert (error.value.field, error.value.code) == ("model", "no_attention_graph")
    assert error.value.message == (
        "model 'tiny-vit' version 1 has no attention graph (attention.onnx with the ViT metadata "
        "fields), so /attention is not available for it; use /predict"
    )


def test_retiring_waits_for_leases_within_its_timeout_and_sums_the_failed_images(loaded, records):
    runtime, settings, serving = loaded

    async def scenario() -> tuple[int, list, float]:
        pipeline = pipeline_of(runtime, serving, settings)
        pipeline.start()
        stops: list[float] = []

        def stub(failed: int):
            async def stop(timeout_s: float) -> int:
                stops.append(timeout_s)
                return failed

            return stop

        pipeline.classifier.stop = stub(2)  # type: ignore[method-assign]
        pipeline.attention.stop = stub(3)  # type: ignore[method-assign,union-attr]
        loop = asyncio.get_running_loop()
        with held(pipeline):
            started = loop.time()
            failed = await asyncio.wait_for(pipeline.retire(0.2), 10)
            waited = loop.time() - started
        return failed, stops, waited

    failed, stops, waited = asyncio.run(scenario())
    assert failed == 5 and stops == [0.2, 0.2] and 0.15 < waited < 5
    assert "tiny-vit version 1: 1 requests still running after 0.2 s; stopping it anyway" in records


def test_retiring_a_drained_version_fails_nothing(loaded):
    runtime, settings, serving = loaded

    async def scenario() -> int:
        pipeline = pipeline_of(runtime, serving, settings)
        pipeline.start()
        return await pipeline.retire(5)

    assert asyncio.run(scenario()) == 0


def test_the_classifier_dispatches_at_a_preferred_batch_size_without_waiting(loaded):
    runtime, settings, serving = loaded
    preferring = dataclasses.replace(serving, max_queue_delay_s=10.0, preferred_batch_sizes=(2,))
    waiting = settings.model_copy(update={"idle_dispatch": False})

    async def scenario() -> int:
        pipeline = pipeline_of(runtime, preferring, waiting)
        pipeline.start()
        run = run_on(pipeline, "classifier", np.zeros((2, 1, 28, 28), np.float32))
        answers = await asyncio.wait_for(run, 5)  # not the 10 s queue delay
        await pipeline.retire(5)
        return len(answers[0])

    assert asyncio.run(scenario()) == 2


def test_a_lone_call_on_an_idle_fast_model_is_answered_before_it_is_waited_for(
    loaded, model_repository
):
    """``enqueue(alone=True)`` runs a lone image inline once the model has shown it is fast: the
    request's reply has the model's answer before ``enqueue`` returns, with the version's lease given
    back first, and the statistics count it; an image the model fails on is answered at once too, as
    its error."""
    runtime, settings, serving = loaded
    rows = np.random.default_rng(1).standard_normal((1, 1, 28, 28)).astype(np.float32)
    session = ort.InferenceSession(str(model_repository / MODEL_NAME / "1" / "model.onnx"))
    expected = session.run(None, {session.get_inputs()[0].name: rows})[0]

    async def scenario():
        pipeline = pipeline_of(runtime, serving, settings)
        pipeline.start()
        await run_on(pipeline, "classifier", rows, alone=True)  # measures the lone run
        handed: list = []
        held_at_reply: list[int] = []

        def reply(request, outputs, error):
            held_at_reply.append(pipeline.in_flight)
            handed.append((outputs, error))

        call = Request(rows, reply, "req-2")
        pipeline.classifier.enqueue([call], alone=True)
        answered, held = call.done, held_at_reply[:1] == [0]  # ended before enqueue returned
        (outputs, _), released = handed[0], pipeline.in_flight
        for instance in pipeline.classifier._instances:
            instance.run = failing
        broken = Request(rows, reply, "req-3")
        pipeline.classifier.enqueue([broken], alone=True)
        failure = handed[1][1]
        stats = pipeline.statistics.as_dict(MODEL_NAME, "1")["inference_stats"]
        await pipeline.retire(5)
        return answered, held, outputs, released, broken.done, failure, stats

    answered, held, outputs, released, broken_answered, failure, stats = asyncio.run(scenario())
    assert answered and held and released == 0
    np.testing.assert_allclose(outputs[0], expected, atol=1e-5)
    assert broken_answered and failure.code == "inference_failed"
    assert stats["success"]["count"] == 2 and stats["fail"]["count"] == 1
    assert stats["queue"]["count"] == 2 and stats["compute_infer"]["count"] == 2


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((1, 1, 27, 28), np.float32),  # another height
        np.zeros((1, 3, 28, 28), np.float32),  # another number of channels
        np.zeros((1, 1, 28, 28), np.float64),  # another dtype
        np.zeros((0, 1, 28, 28), np.float32),  # no image
        np.zeros((1, 784), np.float32),  # not an image
    ],
    ids=["height", "channels", "dtype", "empty", "flat"],
)
def test_rows_that_are_not_the_version_s_input_never_join_a_batch(loaded, bad):
    """Rows of the wrong shape or dtype (from a broken or hostile front end) are refused 422 on their
    own; the honest calls queued in the same turn, which they would have joined, are answered, each
    with the logits onnxruntime gives for its own rows."""
    runtime, settings, serving = loaded
    honest = [np.random.default_rng(i).random((1, 1, 28, 28), np.float32) for i in range(3)]
    session = ort.InferenceSession(str(runtime.files.classifier_path))
    name = session.get_inputs()[0].name
    expected = [session.run(None, {name: rows})[0] for rows in honest]

    async def scenario() -> tuple[list, BaseException | None]:
        pipeline = pipeline_of(runtime, serving, settings)
        pipeline.start()
        outcomes: dict[int, tuple] = {}

        def reply(request, outputs, error):
            outcomes[request.tag] = (outputs, error)

        requests = [Request(rows, reply, tag=i) for i, rows in enumerate([*honest[:2], bad])]
        requests.append(Request(honest[2], reply, tag=3))
        pipeline.classifier.enqueue(requests)  # one turn's calls, queued together
        refused = outcomes.get(2, (None, None))[1]  # answered before enqueue returned
        while len(outcomes) < 4:
            await asyncio.sleep(0.01)
        await pipeline.retire(5)
        return [outcomes[i][0] for i in (0, 1, 3)], refused

    answers, refused = asyncio.run(scenario())
    assert refused is not None and refused.status_code == 422 and refused.field == "rows"
    assert len(answers) == 3
    for answer, want in zip(answers, expected, strict=True):
        assert answer is not None
        np.testing.assert_allclose(answer[0], want, rtol=1e-4, atol=1e-5)


def test_a_call_cancelled_before_its_batch_runs_ends_as_a_499_and_never_runs(loaded):
    """The engine process's cancel (its front end said the client went away): the call is handed
    its 499 through its reply, its row never runs, and its lease is given back."""
    runtime, settings, serving = loaded
    rows = np.zeros((1, 1, 28, 28), np.float32)

    async def scenario():
        pipeline = pipeline_of(runtime, serving, settings)
        ran: list[int] = []
        for instance in pipeline.classifier._instances:
            run = instance.run
            instance.run = lambda images, run=run: (ran.append(len(images)), run(images))[1]
        pipeline.start()
        handed: list = []
        call = Request(
            rows, lambda request, outputs, error: handed.append((outputs, error)), "gone"
        )
        pipeline.classifier.enqueue([call])
        call.cancel()
        await asyncio.sleep(0.05)
        await run_on(pipeline, "classifier", rows, "stays")
        in_flight = pipeline.in_flight
        await pipeline.retire(5)
        return handed, ran, in_flight

    handed, ran, in_flight = asyncio.run(scenario())
    ((outputs, error),) = handed
    assert outputs is None and error.status_code == 499
    assert ran == [1] and in_flight == 0
