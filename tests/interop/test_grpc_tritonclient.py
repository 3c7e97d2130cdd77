"""The Open Inference Protocol over gRPC, spoken by Triton's own ``tritonclient.grpc`` (and, for what that
client never sends, by the stub generated from Triton's service.proto that tritonclient ships).

The numbers it gets back are checked against an onnxruntime session this module opens on the model file
(``Reference``, normalised here from the dataset's statistics) and against ``/predict``. The server is a
real ``python -m service`` process (uvicorn on uvloop, gRPC on the same loop); the tests that need to
reach inside (a failing model run, shutdown) use an in-process app with a real gRPC listener.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as triton
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from service.observability.logs import ContextFilter
from tests.interop.eco_support import (
    eco_app,
    predict_probabilities,
    reference_logits,
    softmax,
)
from tests.support import MAX_IMAGES, MODEL_NAME, Reference, Server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def eco_settings() -> dict[str, object]:
    """``served`` batches over 50 ms, as the suite's own ``server`` does."""
    return {"max_queue_delay_ms": 50}


@pytest.fixture(scope="module")
def server(served) -> Server:
    """The server of ``served``, for the suite's ``http`` client."""
    return served[0]


def fp32_input(tensor: np.ndarray) -> triton.InferInput:
    infer_input = triton.InferInput("images", list(tensor.shape), "FP32")
    infer_input.set_data_from_numpy(tensor)
    return infer_input


def assert_status(error: pytest.ExceptionInfo, code: grpc.StatusCode, *fragments: str) -> str:
    assert error.value.status() == str(code), (error.value.status(), error.value.message())
    for fragment in fragments:
        assert fragment in error.value.message(), (fragment, error.value.message())
    return error.value.message()


# --- health, metadata, config -------------------------------------------------------------------


def test_health_and_metadata(grpc_client, http, model_repository):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready(MODEL_NAME) and grpc_client.is_model_ready(MODEL_NAME, "1")
    assert not grpc_client.is_model_ready(MODEL_NAME, "2")
    assert not grpc_client.is_model_ready("no-such-model")
    server = grpc_client.get_server_metadata(as_json=True)
    assert server == http.get("/v2").json()
    assert {"model_configuration", "statistics", "model_repository"} <= set(server["extensions"])
    graph = onnx.load(str(model_repository / MODEL_NAME / "1" / "model.onnx")).graph
    dims = [d.dim_value or -1 for d in graph.input[0].type.tensor_type.shape.dim]
    metadata = grpc_client.get_model_metadata(MODEL_NAME, as_json=True)
    # the graph's input only: the image files' input is served, not declared
    assert metadata["inputs"] == [
        {"name": graph.input[0].name, "datatype": "FP32", "shape": [str(d) for d in dims]},
    ]
    assert [o["name"] for o in metadata["outputs"]] == [graph.output[0].name, "probabilities"]
    assert metadata["versions"] == ["1"] and metadata["platform"] == "onnxruntime_onnx"


def test_model_config_is_the_file_with_the_settings_in_force(grpc_client, http, model_repository):
    """The config.pbtxt parsed here with Triton's protobuf, with the server's batching settings
    (max_batch_size 8 and a 50 ms delay from the environment) in force; HTTP answers the same."""
    on_disk = text_format.Parse(
        (model_repository / MODEL_NAME / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    config = grpc_client.get_model_config(MODEL_NAME).config
    assert (config.name, config.platform) == (on_disk.name, on_disk.platform)
    # the file's inputs (the graph's) only: the image files' input is served, not declared, since
    # generic clients fill every declared input (docs/decisions.md#encoded-image-input-undeclared)
    assert list(config.input) == list(on_disk.input)
    assert all(tensor.name != "image" for tensor in on_disk.input)
    assert list(config.output) == list(on_disk.output)
    assert config.version_policy == on_disk.version_policy
    assert on_disk.max_batch_size != 8 and config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 50_000
    assert config.dynamic_batching.default_queue_policy.max_queue_size > 0
    as_json = grpc_client.get_model_config(MODEL_NAME, as_json=True)["config"]
    assert http.get(f"/v2/models/{MODEL_NAME}/config").json() == as_json
    assert http.get(f"/v2/models/{MODEL_NAME}/versions/1/config").json() == as_json
    assert grpc_client.get_model_config(MODEL_NAME, "1").config == config
    with pytest.raises(InferenceServerException) as error:
        grpc_client.get_model_config(MODEL_NAME, "7")
    assert_status(error, grpc.StatusCode.NOT_FOUND, "unknown version '7'")


# --- inference ----------------------------------------------------------------------------------


def test_fp32_raw_contents_agree_with_onnxruntime_and_predict(
    grpc_client, http, reference, fashion_images
):
    images = fashion_images[:MAX_IMAGES]
    tensor = Reference.normalise(images)
    result = grpc_client.infer(
        MODEL_NAME,
        [fp32_input(tensor)],
        outputs=[
            triton.InferRequestedOutput("logits"),
            triton.InferRequestedOutput("probabilities"),
        ],
        request_id="grpc-fp32",
    )
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (
        MODEL_NAME,
        "1",
        "grpc-fp32",
    )
    logits, probabilities = result.as_numpy("logits"), result.as_numpy("probabilities")
    expected = reference_logits(reference, tensor)
    assert len(set(np.argmax(expected, axis=1).tolist())) > 1, "the images must differ"
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(probabilities, softmax(expected), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        probabilities, predict_probabilities(http, images), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("layout", ["NCHW", "NHW"])
def test_uint8_raw_contents_are_normalised_like_the_reference(
    grpc_client, reference, fashion_images, layout
):
    images = fashion_images[8:14]
    tensor = np.ascontiguousarray(images[:, None] if layout == "NCHW" else images)
    infer_input = triton.InferInput("images", list(tensor.shape), "UINT8")
    infer_input.set_data_from_numpy(tensor)
    result = grpc_client.infer(MODEL_NAME, [infer_input])  # no output named: every output
    assert [o.name for o in result.get_response().outputs] == ["logits", "probabilities"]
    np.testing.assert_allclose(
        result.as_numpy("probabilities"), reference.probabilities(images), rtol=1e-4, atol=1e-6
    )


def typed_request(
    datatype: str, shape: list[int], **contents: object
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    tensor = request.inputs.add(name="images", datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    request.outputs.add(name="logits")
    return request


@pytest.mark.parametrize("datatype", ["FP32", "UINT8"])
def test_typed_contents_agree_with_onnxruntime(stub, reference, fashion_images, datatype):
    images = fashion_images[16:19]
    tensor = Reference.normalise(images)
    if datatype == "FP32":
        request = typed_request("FP32", [3, 1, 28, 28], fp32_contents=tensor.reshape(-1).tolist())
    else:
        request = typed_request("UINT8", [3, 28, 28], uint_contents=images.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("logits", "FP32", [3, 10])
    ]
    logits = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(3, 10)
    np.testing.assert_allclose(logits, reference_logits(reference, tensor), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("request_", "fragments"),
    [
        (
            typed_request("UINT8", [1, 28, 28], uint_contents=[0] * 783 + [256]),
            ["contents.uint_contents", "element 783 is 256", "0 to 255"],
        ),
        (
            typed_request("FP32", [1, 1, 28, 28], fp32_contents=[0.0] * 700),
            ["contents.fp32_contents holds 700 elements", "needs 784"],
        ),
        (
            typed_request("FP32", [1, 1, 28, 28], int_contents=[0] * 784),
            ["takes contents.fp32_contents, not contents.int_contents"],
        ),
        (
            typed_request("FP32", [1, 1, 28, 28], fp32_contents=[float("inf")] + [0.0] * 783),
            ["element 0 is inf", "must be finite"],
        ),
    ],
    ids=["uint8-range", "count", "wrong-field", "not-finite"],
)
def test_bad_typed_contents_are_invalid_argument(stub, request_, fragments):
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request_)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for fragment in fragments:
        assert fragment in error.value.details(), (fragment, error.value.details())


def test_classification_names_the_labels(grpc_client, reference, model_repository, fashion_images):
    images = fashion_images[:4]
    tensor = Reference.normalise(images)
    labels = (model_repository / MODEL_NAME / "1" / "labels.txt").read_text().splitlines()
    result = grpc_client.infer(
        MODEL_NAME,
        [fp32_input(tensor)],
        outputs=[triton.InferRequestedOutput("logits", class_count=3)],
    )
    classes = result.as_numpy("logits")
    assert classes.shape == (4, 3)
    for row, entries in zip(reference_logits(reference, tensor), classes, strict=True):
        parsed = [entry.decode("utf-8").split(":", 2) for entry in entries]
        top = np.argsort(-row, kind="stable")[:3].tolist()
        assert [(int(index), label) for _, index, label in parsed] == [(i, labels[i]) for i in top]
        for value, index, _ in parsed:
            assert float(value) == pytest.approx(float(row[int(index)]), abs=1e-4)


# --- errors ---------------------------------------------------------------------------------------


def test_errors_are_grpc_statuses_with_the_http_message(grpc_client, http, served):
    tensor = np.zeros((1, 1, 28, 28), np.float32)
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer("resnet50", [fp32_input(tensor)])
    assert_status(error, grpc.StatusCode.NOT_FOUND, "unknown model 'resnet50'", MODEL_NAME)
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer(MODEL_NAME, [fp32_input(tensor)], model_version="2")
    assert_status(error, grpc.StatusCode.NOT_FOUND, "unknown version '2'")

    wrong_shape = np.zeros((2, 1, 27, 28), np.float32)
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer(MODEL_NAME, [fp32_input(wrong_shape)])
    message = assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "shape [2, 1, 27, 28]")
    body = {"inputs": [{"name": "images", "shape": [2, 1, 27, 28], "datatype": "FP32"}]}
    body["inputs"][0]["data"] = [0.0] * wrong_shape.size
    assert http.post(f"/v2/models/{MODEL_NAME}/infer", json=body).json() == {"error": message}

    too_many = np.zeros((MAX_IMAGES + 1, 1, 28, 28), np.float32)
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer(MODEL_NAME, [fp32_input(too_many)])
    assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, f"max_images_per_request={MAX_IMAGES}")

    # The body limit (256 KiB here) bounds a gRPC message too.
    huge = triton.InferInput("images", [1, 1, 28, 28], "FP32")
    huge.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.float32))
    huge._raw_content = bytes(300 * 1024)
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer(MODEL_NAME, [huge])
    assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED)

    with pytest.raises(InferenceServerException) as error:
        grpc_client.get_system_shared_memory_status()
    assert_status(error, grpc.StatusCode.UNIMPLEMENTED, "SystemSharedMemoryStatus")
    with pytest.raises(InferenceServerException) as error:
        grpc_client.load_model(MODEL_NAME)  # the model control mode is 'none'
    message = assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "model control mode is 'none'")
    assert http.post(f"/v2/repository/models/{MODEL_NAME}/load").json() == {"error": message}
    assert grpc_client.is_server_ready()  # and it keeps serving


class Records(logging.Handler):
    """vitserve's log records, with the request and trace ids its JSON lines carry."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.addFilter(ContextFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_failing_model_run_is_internal_and_names_the_request(model_repository):
    records = Records()
    logging.getLogger("vitserve").addHandler(records)
    try:
        with eco_app(model_repository) as app_client:
            pipeline = app_client.app.state.engine.manager.resolve(MODEL_NAME)

            def broken(images: np.ndarray) -> list[np.ndarray]:
                raise RuntimeError("injected: onnxruntime failed")

            for instance in pipeline.classifier._instances:  # whichever runs the batch
                instance.run = broken
            port = app_client.app.state.settings.server.grpc_port
            with triton.InferenceServerClient(f"127.0.0.1:{port}") as grpc_client:
                tensor = np.zeros((1, 1, 28, 28), np.float32)
                with pytest.raises(InferenceServerException) as error:
                    grpc_client.infer(
                        MODEL_NAME, [fp32_input(tensor)], headers={"x-request-id": "fault-42"}
                    )
    finally:
        logging.getLogger("vitserve").removeHandler(records)
    assert_status(error, grpc.StatusCode.INTERNAL, "the model failed", "RuntimeError")
    # the call's own log line carries its request id (a field of every JSON log line)
    assert any(
        r.request_id == "fault-42" and "inference_failed" in r.getMessage() for r in records.records
    ), [(r.request_id, r.getMessage()) for r in records.records]


def test_api_key_is_bearer_metadata(model_repository, fashion_images):
    with (
        eco_app(model_repository, api_key="grpc-key") as app_client,
        triton.InferenceServerClient(
            f"127.0.0.1:{app_client.app.state.settings.server.grpc_port}"
        ) as grpc_client,
    ):
        assert grpc_client.is_server_live() and grpc_client.is_server_ready()
        assert grpc_client.get_server_metadata().name == "vitserve"
        tensor = Reference.normalise(fashion_images[:1])
        for headers, fragment in (
            (None, "Authorization: Bearer"),
            ({"authorization": "Bearer nope"}, "not valid"),
            ({"authorization": "Basic grpc-key"}, "must be 'Bearer <API key>'"),
        ):
            with pytest.raises(InferenceServerException) as error:
                grpc_client.infer(MODEL_NAME, [fp32_input(tensor)], headers=headers)
            assert_status(error, grpc.StatusCode.UNAUTHENTICATED, fragment)
        with pytest.raises(InferenceServerException) as error:
            grpc_client.get_model_metadata(MODEL_NAME)
        assert_status(error, grpc.StatusCode.UNAUTHENTICATED)
        good = {"authorization": "Bearer grpc-key"}
        assert grpc_client.is_model_ready(MODEL_NAME, headers=good)
        result = grpc_client.infer(MODEL_NAME, [fp32_input(tensor)], headers=good)
        assert result.as_numpy("logits").shape == (1, 10)


# --- statistics -----------------------------------------------------------------------------------


def stats_of(grpc_client: triton.InferenceServerClient) -> service_pb2.ModelStatistics:
    (entry,) = grpc_client.get_inference_statistics(MODEL_NAME).model_stats
    return entry


def test_statistics_count_exactly_what_was_sent(grpc_client, http):
    before = stats_of(grpc_client)
    sizes = [1, 3, 2]
    for size in sizes:
        grpc_client.infer(MODEL_NAME, [fp32_input(np.zeros((size, 1, 28, 28), np.float32))])
    with pytest.raises(InferenceServerException):
        grpc_client.infer(MODEL_NAME, [fp32_input(np.zeros((1, 1, 27, 28), np.float32))])
    after = stats_of(grpc_client)
    assert (after.name, after.version) == (MODEL_NAME, "1")
    assert after.inference_count - before.inference_count == sum(sizes)
    stats, earlier = after.inference_stats, before.inference_stats
    assert stats.success.count - earlier.success.count == len(sizes)
    assert stats.fail.count - earlier.fail.count == 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(stats, stage).count - getattr(earlier, stage).count == len(sizes), stage
        # an idle model runs a request at once: its time in the queue may be 0
        grew = getattr(stats, stage).ns - getattr(earlier, stage).ns
        assert grew >= 0 if stage == "queue" else grew > 0, stage
    executions = after.execution_count - before.execution_count
    assert 1 <= executions <= len(sizes)
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count
    assert after.last_inference >= before.last_inference > 0
    # success takes longer than the compute it holds
    assert stats.success.ns - earlier.success.ns > stats.compute_infer.ns - earlier.compute_infer.ns
    # HTTP answers the same numbers (nothing ran in between)
    (over_http,) = http.get(f"/v2/models/{MODEL_NAME}/stats").json()["model_stats"]
    assert over_http["inference_count"] == after.inference_count
    assert over_http["inference_stats"]["success"]["ns"] == stats.success.ns


# --- the model repository -------------------------------------------------------------------------


def test_repository_index_load_and_unload(model_repository, fashion_images):
    tensor = Reference.normalise(fashion_images[:1])
    with (
        eco_app(model_repository, model_control="explicit", models=MODEL_NAME) as app_client,
        triton.InferenceServerClient(
            f"127.0.0.1:{app_client.app.state.settings.server.grpc_port}"
        ) as grpc_client,
    ):
        index = grpc_client.get_model_repository_index(as_json=True)["models"]
        assert index == [{"name": MODEL_NAME, "version": "1", "state": "READY"}]
        assert app_client.post("/v2/repository/index").json() == [{**index[0], "reason": ""}]
        grpc_client.unload_model(MODEL_NAME)
        (row,) = grpc_client.get_model_repository_index().models
        assert (row.name, row.state, row.reason) == (MODEL_NAME, "UNAVAILABLE", "unloaded")
        assert not grpc_client.is_model_ready(MODEL_NAME)
        with pytest.raises(InferenceServerException) as error:
            grpc_client.infer(MODEL_NAME, [fp32_input(tensor)])
        assert_status(error, grpc.StatusCode.NOT_FOUND, f"'{MODEL_NAME}' is not loaded")
        with pytest.raises(InferenceServerException) as error:
            grpc_client.load_model(MODEL_NAME, config='{"max_batch_size": 2}')
        message = assert_status(
            error, grpc.StatusCode.INVALID_ARGUMENT, "load parameters", "config"
        )
        over_http = app_client.post(
            f"/v2/repository/models/{MODEL_NAME}/load",
            json={"parameters": {"config": '{"max_batch_size": 2}'}},
        )
        assert (over_http.status_code, over_http.json()) == (400, {"error": message})
        with pytest.raises(InferenceServerException) as error:
            grpc_client.load_model("no-such-model")
        assert_status(error, grpc.StatusCode.NOT_FOUND, "no-such-model")
        grpc_client.load_model(MODEL_NAME)
        assert grpc_client.is_model_ready(MODEL_NAME)
        assert grpc_client.get_model_repository_index().models[0].state == "READY"
        assert grpc_client.infer(MODEL_NAME, [fp32_input(tensor)]).as_numpy("logits").shape == (
            1,
            10,
        )


# --- cancellation and shutdown --------------------------------------------------------------------


def test_a_call_past_its_deadline_never_runs(model_repository):
    with eco_app(model_repository, max_queue_delay_ms=1500, idle_dispatch=False) as app_client:
        port = app_client.app.state.settings.server.grpc_port
        with triton.InferenceServerClient(f"127.0.0.1:{port}") as grpc_client:
            tensor = np.zeros((2, 1, 28, 28), np.float32)
            with pytest.raises(InferenceServerException) as error:
                grpc_client.infer(MODEL_NAME, [fp32_input(tensor)], client_timeout=0.3)
            assert_status(error, grpc.StatusCode.DEADLINE_EXCEEDED)
            # a later call is answered once a batch has run: the abandoned images, queued before
            # it, would have run in that batch or an earlier one (no fixed wait for the delay)
            later = np.zeros((1, 1, 28, 28), np.float32)
            assert grpc_client.infer(MODEL_NAME, [fp32_input(later)]).as_numpy("logits").shape
            stats = stats_of(grpc_client)
            assert (stats.inference_count, stats.execution_count) == (1, 1)


def test_shutdown_lets_the_calls_in_flight_finish(model_repository, reference, fashion_images):
    """Shutdown while a call waits in a batcher that holds batches for 3 s: the call is answered,
    and the port refuses calls once the app has stopped."""
    tensor = Reference.normalise(fashion_images[:2])
    answers: list[object] = []
    with eco_app(model_repository, max_queue_delay_ms=3000, idle_dispatch=False) as app_client:
        port = app_client.app.state.settings.server.grpc_port
        grpc_client = triton.InferenceServerClient(f"127.0.0.1:{port}")

        def call() -> None:
            try:
                answers.append(grpc_client.infer(MODEL_NAME, [fp32_input(tensor)]))
            except InferenceServerException as error:
                answers.append(error)

        caller = threading.Thread(target=call)
        caller.start()
        pipeline = app_client.app.state.engine.manager.resolve(MODEL_NAME)
        deadline = time.monotonic() + 10
        while not pipeline.classifier.queued and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pipeline.classifier.queued, "the call never reached the queue"
    caller.join(30)
    (answer,) = answers
    assert not isinstance(answer, Exception), answer
    np.testing.assert_allclose(
        answer.as_numpy("logits"), reference_logits(reference, tensor), rtol=1e-4, atol=1e-4
    )
    with pytest.raises(InferenceServerException) as error:
        grpc_client.is_server_live(client_timeout=2)
    assert error.value.status() in {"StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"}
    grpc_client.close()
