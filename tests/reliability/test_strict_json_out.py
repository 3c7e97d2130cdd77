"""Strict JSON out: no answer holds NaN or Infinity.

- An FP32 tensor element outside the model's ``input.range`` is a 400 naming it and the range, over
  HTTP and gRPC (3e38 is finite, and the model turns it into NaN).
- A model producing NaN for an image answers that request 500 naming the model, counted in
  ``vitserve_non_finite_outputs_total``; the other requests of its batch are answered as usual (the
  model's NaN is never a 200 with ``"score": NaN``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.launcher.local_app import local_app
from tests.support import MODEL_NAME, RELIABILITY, free_port, make_settings, metric


def strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in an answer")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def app_and_grpc(model_repository) -> Iterator[tuple[TestClient, int]]:
    port = free_port(RELIABILITY.ports)
    settings = make_settings(
        model_repository, RELIABILITY, grpc_port=port, max_queue_delay_ms=300.0
    )
    with TestClient(local_app(settings), raise_server_exceptions=False) as client:
        yield client, port


def infer_body(values: np.ndarray) -> dict:
    return {
        "inputs": [
            {
                "name": "images",
                "shape": list(values.shape),
                "datatype": "FP32",
                "data": values.reshape(-1).tolist(),
            }
        ]
    }


@pytest.mark.parametrize("hostile", [3e38, -3e38, 1000.0, -1000.0])
def test_fp32_elements_outside_the_input_range_are_refused_over_http(app_and_grpc, hostile):
    client, _ = app_and_grpc
    values = np.zeros((1, 1, 28, 28), np.float32)
    values[0, 0, 3, 5] = hostile
    response = client.post(f"/v2/models/{MODEL_NAME}/infer", json=infer_body(values))
    assert response.status_code == 400, response.text
    message = strict(response.text)["error"]
    assert "element 89" in message and "input.range" in message


def test_fp32_elements_inside_the_range_are_served(app_and_grpc):
    client, _ = app_and_grpc
    meta = client.app.state.frontend.engine.engine.manager.resolve(MODEL_NAME).metadata
    low, high = meta.input_range
    values = np.where(np.arange(784) % 2, low, high).astype(np.float32).reshape(1, 1, 28, 28)
    response = client.post(f"/v2/models/{MODEL_NAME}/infer", json=infer_body(values))
    assert response.status_code == 200
    assert all(np.isfinite(output["data"]).all() for output in strict(response.text)["outputs"])


def test_fp32_elements_outside_the_input_range_are_refused_over_grpc(app_and_grpc):
    _, port = app_and_grpc
    values = np.full((1, 1, 28, 28), 3e38, np.float32)
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    tensor = request.inputs.add(name="images", datatype="FP32", shape=[1, 1, 28, 28])
    del tensor
    request.raw_input_contents.append(values.tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input.range" in error.value.details()


def test_a_model_producing_nan_answers_500_naming_it_and_counts_it(
    app_and_grpc, fashion_images, monkeypatch
):
    client, _ = app_and_grpc
    runtime = client.app.state.frontend.engine.engine.manager.resolve(MODEL_NAME).runtime
    real = runtime.classify

    def nan_for_white(images: np.ndarray, instance: int = 0) -> np.ndarray:
        logits = real(images, instance)
        logits[images.reshape(len(images), -1).min(axis=1) > 2.0] = np.nan  # all-white images
        return logits

    monkeypatch.setattr(runtime, "classify", nan_for_white)
    before = client.get("/metrics").text
    white = {"images": [{"pixels": [[255] * 28] * 28}], "invert": "never"}
    good = {"images": [{"pixels": fashion_images[0].tolist()}], "invert": "never"}
    with ThreadPoolExecutor(2) as pool:  # one batch: the queue waits 300 ms for partners
        bad_answer, good_answer = pool.map(
            lambda body: client.post("/predict", json=body), [white, good]
        )
    assert bad_answer.status_code == 500, bad_answer.text
    error = strict(bad_answer.text)["error"]
    assert error["code"] == "non_finite_output" and f"model '{MODEL_NAME}'" in error["message"]
    assert good_answer.status_code == 200
    strict(good_answer.text)
    v2 = client.post(
        f"/v2/models/{MODEL_NAME}/infer", json=infer_body(np.full((1, 1, 28, 28), 2.8, np.float32))
    )
    assert v2.status_code == 500 and "NaN" in strict(v2.text)["error"]
    after = client.get("/metrics").text
    name = "vitserve_non_finite_outputs_total"
    labels = {"model": MODEL_NAME, "graph": "classifier"}
    assert metric(after, name, **labels) == metric(before, name, **labels) + 2
