"""The Open Inference Protocol (KServe v2) against a real uvicorn process, spoken by Triton's own client.

``tritonclient.http`` is NVIDIA's client for Triton Inference Server; nobody here wrote it. What it
accepts here, it accepts from Triton and KServe. The numbers it gets back are checked against an
onnxruntime session this module opens itself on the same model file, fed tensors normalised here from
the model's metadata (read with ``onnx``): never against another route of the same server, which would
share any bug of the batcher or the runtime.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support import BASE_SETTINGS, INTEROP, MODEL_NAME, REPO, metric, running_server

ONNX_TYPES = {onnx.TensorProto.FLOAT: "FP32"}


@dataclass(frozen=True)
class OnnxReference:
    """The classifier graph run in this process, and the normalisation its metadata states."""

    session: ort.InferenceSession
    scale: float
    mean: np.ndarray  # [C, 1, 1]
    std: np.ndarray  # [C, 1, 1]

    @classmethod
    def open(cls, model_file: Path) -> OnnxReference:
        properties = {p.key: p.value for p in onnx.load(str(model_file)).metadata_props}
        preprocessing = json.loads(properties["vitserve"])["preprocessing"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
        return cls(
            session,
            float(preprocessing["scale"]),
            np.asarray(preprocessing["mean"], dtype=np.float64).reshape(-1, 1, 1),
            np.asarray(preprocessing["std"], dtype=np.float64).reshape(-1, 1, 1),
        )

    def normalise(self, images: np.ndarray) -> np.ndarray:
        """uint8 [N, H, W] or [N, C, H, W] -> (x * scale - mean) / std as float32 [N, C, H, W]."""
        pixels = images[:, None] if images.ndim == 3 else images
        return ((pixels.astype(np.float64) * self.scale - self.mean) / self.std).astype(np.float32)

    def logits(self, tensor: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run(["logits"], {"images": tensor})
        return logits

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """uint8 pixels -> softmax of the graph's logits [N, classes]."""
        return softmax(self.logits(self.normalise(images)).astype(np.float64))


@pytest.fixture(scope="module")
def onnx_reference(model_repository: Path) -> OnnxReference:
    return OnnxReference.open(model_repository / MODEL_NAME / "1" / "model.onnx")


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8) as c:
        yield c


def fp32_input(
    images: np.ndarray, reference: OnnxReference, binary: bool = False
) -> triton.InferInput:
    """uint8 [N, 28, 28] -> the normalised FP32 tensor [N, 1, 28, 28] the graph takes."""
    tensor = reference.normalise(images)
    infer_input = triton.InferInput("images", list(tensor.shape), "FP32")
    infer_input.set_data_from_numpy(tensor, binary_data=binary)
    return infer_input


def outputs(binary: bool = False) -> list[triton.InferRequestedOutput]:
    return [
        triton.InferRequestedOutput("logits", binary_data=binary),
        triton.InferRequestedOutput("probabilities", binary_data=binary),
    ]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def assert_oip_error(
    error: pytest.ExceptionInfo[InferenceServerException], status: int, *fragments: str
) -> None:
    assert error.value.status() == str(status), error.value
    message = error.value.message()
    assert isinstance(message, str), f"the error body is not {{'error': '<string>'}}: {message!r}"
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# --- health and metadata ----------------------------------------------------------------------------


def test_health_and_server_metadata(client, http):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL_NAME)
    assert client.is_model_ready(MODEL_NAME, "1")
    assert not client.is_model_ready(MODEL_NAME, "2")
    assert not client.is_model_ready("no-such-model")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "vitserve"
    assert metadata["version"] == http.get("/openapi.json").json()["info"]["version"]
    assert {"binary_tensor_data", "classification"} <= set(metadata["extensions"])
    for path, body in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True})):
        response = http.get(path)
        assert (response.status_code, response.json()) == (200, body)  # KServe's bodies


def test_model_metadata_is_the_onnx_graph(client, model_repository: Path):
    graph = onnx.load(str(model_repository / MODEL_NAME / "1" / "model.onnx")).graph

    def tensors(values) -> list[dict]:
        return [
            {
                "name": value.name,
                "datatype": ONNX_TYPES[value.type.tensor_type.elem_type],
                "shape": [
                    d.dim_value if d.HasField("dim_value") else -1
                    for d in value.type.tensor_type.shape.dim
                ],
            }
            for value in values
        ]

    metadata = client.get_model_metadata(MODEL_NAME)
    assert metadata["name"] == MODEL_NAME
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    # The graph's input only: the image files' input is served, not declared (generic clients
    # fill every input the metadata lists).
    assert tensors(graph.input) == [
        {"name": "images", "datatype": "FP32", "shape": [-1, 1, 28, 28]}
    ]
    assert metadata["inputs"] == tensors(graph.input)
    # The graph's outputs, then the one vitserve adds.
    classes = metadata["outputs"][0]["shape"][1]
    assert metadata["outputs"] == [
        *tensors(graph.output),
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, classes]},
    ]
    assert client.get_model_metadata(MODEL_NAME, "1") == metadata


def test_unknown_model_and_version_are_404(client, onnx_reference):
    with pytest.raises(InferenceServerException) as error:
        client.get_model_metadata("resnet50")
    assert_oip_error(error, 404, "unknown model 'resnet50'", MODEL_NAME)
    with pytest.raises(InferenceServerException) as error:
        client.get_model_metadata(MODEL_NAME, "3")
    assert_oip_error(error, 404, "unknown version '3'", "version 1")
    images = np.zeros((1, 28, 28), dtype=np.uint8)
    with pytest.raises(InferenceServerException) as error:
        client.infer("resnet50", [fp32_input(images, onnx_reference)])
    assert_oip_error(error, 404, "unknown model 'resnet50'")
    with pytest.raises(InferenceServerException) as error:
        client.infer(MODEL_NAME, [fp32_input(images, onnx_reference)], model_version="2")
    assert_oip_error(error, 404, "unknown version '2'")


def test_routes_outside_the_protocol_answer_in_its_error_shape(client, http):
    """Triton-only routes (shared memory, trace settings) and wrong methods: 404 and 405, as
    {"error": "..."} that tritonclient reads as a message."""
    with pytest.raises(InferenceServerException) as error:
        client.get_system_shared_memory_status()
    assert_oip_error(error, 404, "/v2/systemsharedmemory/status is not served")
    with pytest.raises(InferenceServerException) as error:
        client.get_trace_settings()
    assert_oip_error(error, 404, "is not served")
    wrong_method = http.get(f"/v2/models/{MODEL_NAME}/infer")
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json() == {
        "error": f"method GET is not allowed on /v2/models/{MODEL_NAME}/infer; use POST"
    }


def test_a_body_over_the_limit_is_413_in_the_protocols_error_shape(http):
    """The body limit answers before routing; on /v2 it must still speak {"error": "..."}."""
    response = http.post(
        f"/v2/models/{MODEL_NAME}/infer",
        content=b"0" * (BASE_SETTINGS["max_body_bytes"] + 1),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    body = response.json()
    limit = BASE_SETTINGS["max_body_bytes"]
    assert list(body) == ["error"] and f"max_body_bytes={limit}" in body["error"]


# --- inference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_fp32_infer_matches_onnxruntime(client, onnx_reference, fashion_images, binary):
    images = fashion_images[:8]
    tensor = onnx_reference.normalise(images)
    result = client.infer(
        MODEL_NAME,
        [fp32_input(images, onnx_reference, binary)],
        outputs=outputs(binary),
        request_id="fp32-batch",
    )
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (
        MODEL_NAME,
        "1",
        "fp32-batch",
    )
    logits = result.as_numpy("logits")
    probabilities = result.as_numpy("probabilities")
    assert logits.dtype == probabilities.dtype == np.float32
    assert logits.shape == probabilities.shape == (8, 10)
    expected_logits = onnx_reference.logits(tensor)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)
    expected = softmax(expected_logits.astype(np.float64))
    np.testing.assert_allclose(probabilities, expected, rtol=1e-4, atol=1e-6)
    assert len(set(np.argmax(expected, axis=1).tolist())) > 1, "the images must not look alike"


@pytest.mark.parametrize("layout", ["NCHW", "NHW"])
def test_uint8_pixels_are_normalised_from_the_metadata(
    client, onnx_reference, fashion_images, layout
):
    """UINT8 pixels become (x * scale - mean) / std with the metadata's numbers, then the graph."""
    images = fashion_images[8:14]
    tensor = images[:, None] if layout == "NCHW" else images
    infer_input = triton.InferInput("images", list(tensor.shape), "UINT8")
    infer_input.set_data_from_numpy(np.ascontiguousarray(tensor), binary_data=False)
    result = client.infer(MODEL_NAME, [infer_input], outputs=outputs())
    expected = onnx_reference.probabilities(images)
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, rtol=1e-4, atol=1e-6)
    assert np.argmax(result.as_numpy("logits"), axis=1).tolist() == np.argmax(expected, 1).tolist()


def test_no_requested_outputs_returns_every_output_in_binary(
    client, onnx_reference, fashion_images
):
    """tritonclient asks for binary_data_output when no output is named: Triton's default path."""
    images = fashion_images[14:17]
    result = client.infer(MODEL_NAME, [fp32_input(images, onnx_reference, binary=True)])
    names = [output["name"] for output in result.get_response()["outputs"]]
    assert names == ["logits", "probabilities"]
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    np.testing.assert_allclose(
        result.as_numpy("probabilities"),
        onnx_reference.probabilities(images),
        rtol=1e-4,
        atol=1e-6,
    )


def test_classification_extension_names_the_labels(
    client, onnx_reference, model_repository, fashion_images
):
    images = fashion_images[:4]
    labels = (model_repository / MODEL_NAME / "1" / "labels.txt").read_text().splitlines()
    logits = onnx_reference.logits(onnx_reference.normalise(images))
    result = client.infer(
        MODEL_NAME,
        [fp32_input(images, onnx_reference)],
        outputs=[triton.InferRequestedOutput("logits", class_count=3)],
    )
    classes = result.as_numpy("logits")
    assert classes.shape == (4, 3)
    for row, entries in zip(logits, classes, strict=True):
        parsed = [entry.decode("utf-8").split(":", 2) for entry in entries]
        assert [int(index) for _, index, _ in parsed] == np.argsort(-row, kind="stable")[
            :3
        ].tolist()
        for value, index, label in parsed:
            assert label == labels[int(index)]
            assert float(value) == pytest.approx(float(row[int(index)]), abs=1e-4)


# 24 callers of one image each, into a batcher that waits up to 2 s for a batch of up to 24: the
# callers share batches, so a batcher that hands a caller another caller's row fails the test.
CALLERS = 24


@pytest.fixture(scope="module")
def batching_server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("interop-batching") / "service.log"
    with running_server(
        model_repository,
        log,
        suite=INTEROP,
        max_queue_delay_ms=2000,
        max_batch_size=CALLERS,
        max_queue_size=4 * CALLERS,
        # Triton's batching: wait out the delay for partners (by default an idle model runs what
        # is queued at once, and callers arriving a little apart would each run alone)
        idle_dispatch="false",
    ) as running:
        yield running


def test_concurrent_callers_share_batches_and_each_gets_its_own_row(
    batching_server, onnx_reference, fashion_images
):
    """Threads, each with its own tritonclient, released together: several callers per batch, and
    every caller's logits are those of its own image (onnxruntime in this process)."""
    images = fashion_images[:CALLERS]
    expected = onnx_reference.logits(onnx_reference.normalise(images))
    assert len({tuple(np.round(row, 3)) for row in expected}) == CALLERS  # every row differs
    url = batching_server.url.removeprefix("http://")
    before = httpx.get(f"{batching_server.url}/metrics").text
    start = threading.Barrier(CALLERS)

    def call(index: int) -> np.ndarray:
        with triton.InferenceServerClient(url, network_timeout=60) as own:
            infer_input = fp32_input(images[index : index + 1], onnx_reference)
            start.wait(30)
            result = own.infer(MODEL_NAME, [infer_input], outputs=outputs()[:1])
            return result.as_numpy("logits")[0]

    with ThreadPoolExecutor(CALLERS) as pool:
        answers = list(pool.map(call, range(CALLERS)))
    after = httpx.get(f"{batching_server.url}/metrics").text

    def delta(name: str) -> float:
        return metric(after, name, graph="classifier") - metric(before, name, graph="classifier")

    assert delta("vitserve_batch_size_sum") == CALLERS
    executions = delta("vitserve_batch_size_count")
    assert executions <= CALLERS // 3, f"{CALLERS} callers ran in {executions} batches"
    for index, (answer, row) in enumerate(zip(answers, expected, strict=True)):
        np.testing.assert_allclose(answer, row, rtol=1e-4, atol=1e-4, err_msg=f"caller {index}")


def test_v2_requests_share_the_predict_batcher(server, http, fashion_images):
    """OIP and /predict requests go through the same classifier batcher."""
    images = fashion_images[:4]
    before = http.get("/metrics").text
    body = {"images": [{"pixels": image.tolist()} for image in images]}
    assert http.post("/predict", json=body).status_code == 200
    tensor = {"name": "images", "shape": [4, 28, 28], "datatype": "UINT8"}
    answer = http.post(
        f"/v2/models/{MODEL_NAME}/infer",
        json={"inputs": [{**tensor, "data": images.reshape(-1).tolist()}]},
    )
    assert answer.status_code == 200, answer.text
    after = http.get("/metrics").text
    images_run = metric(after, "vitserve_batch_size_sum", graph="classifier") - metric(
        before, "vitserve_batch_size_sum", graph="classifier"
    )
    assert images_run == 8  # both routes' images went through the classifier batcher


def test_nested_and_flat_data_agree(http, onnx_reference, fashion_images):
    images = fashion_images[:2]
    path = f"/v2/models/{MODEL_NAME}/infer"

    def run(data) -> list[float]:
        body = {
            "inputs": [
                {"name": "images", "shape": [2, 1, 28, 28], "datatype": "UINT8", "data": data}
            ],
            "outputs": [{"name": "logits"}],
        }
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        assert (output["datatype"], output["shape"]) == ("FP32", [2, 10])
        return output["data"]

    flat = run(images.reshape(-1).tolist())
    assert flat == run(images[:, None].tolist()) == run(images.tolist())
    expected = onnx_reference.logits(onnx_reference.normalise(images))
    np.testing.assert_allclose(np.reshape(flat, (2, 10)), expected, rtol=1e-4, atol=1e-4)


# --- errors --------------------------------------------------------------------------------------------


def test_wrong_input_name_datatype_and_shape_are_400(client, onnx_reference, fashion_images):
    images = fashion_images[:2]
    tensor = onnx_reference.normalise(images)
    wrong_name = triton.InferInput("pixels", list(tensor.shape), "FP32")
    wrong_name.set_data_from_numpy(tensor)
    with pytest.raises(InferenceServerException) as error:
        client.infer(MODEL_NAME, [wrong_name])
    assert_oip_error(error, 400, "unexpected inference input 'pixels'", "'images'")

    wrong_type = triton.InferInput("images", list(tensor.shape), "INT32")
    wrong_type.set_data_from_numpy(tensor.astype(np.int32))
    with pytest.raises(InferenceServerException) as error:
        client.infer(MODEL_NAME, [wrong_type])
    assert_oip_error(error, 400, "datatype INT32 is not accepted", "FP32", "UINT8")

    wrong_shape = triton.InferInput("images", [2, 1, 27, 28], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((2, 1, 27, 28), np.float32), binary_data=False)
    with pytest.raises(InferenceServerException) as error:
        client.infer(MODEL_NAME, [wrong_shape])
    assert_oip_error(error, 400, "shape [2, 1, 27, 28]", "[N, 1, 28, 28]")

    three_d_fp32 = triton.InferInput("images", [2, 28, 28], "FP32")
    three_d_fp32.set_data_from_numpy(tensor[:, 0])
    with pytest.raises(InferenceServerException) as error:
        client.infer(MODEL_NAME, [three_d_fp32])
    assert_oip_error(error, 400, "shape [2, 28, 28]", "FP32")

    with pytest.raises(InferenceServerException) as error:
        client.infer(
            MODEL_NAME,
            [fp32_input(images, onnx_reference)],
            outputs=[triton.InferRequestedOutput("attention", binary_data=False)],
        )
    assert_oip_error(error, 400, "unexpected inference output 'attention'", "'logits'")
    assert client.is_server_ready()  # and it keeps serving


@pytest.mark.parametrize(
    ("tensor", "fragments"),
    [
        (
            {"shape": [2, 1, 28, 28], "datatype": "FP32", "data": [0.0] * 784},
            ["holds 784 elements", "needs 1568"],
        ),
        (
            {"shape": [1, 28, 28], "datatype": "UINT8", "data": [0] * 783 + [256]},
            ["element 783 is 256", "0 to 255"],
        ),
        (
            {"shape": [1, 28, 28], "datatype": "UINT8", "data": [0] * 783 + [0.5]},
            ["element 783 is 0.5"],
        ),
        (
            {"shape": [1, 1, 28, 28], "datatype": "FP32", "data": ["1.0"] * 784},
            ['element 0 is "1.0", not a number'],
        ),
        (
            {"shape": [9, 28, 28], "datatype": "UINT8", "data": [0] * (9 * 784)},
            ["batch size 9", "max_images_per_request=8"],
        ),
        (
            {"shape": [0, 28, 28], "datatype": "UINT8", "data": []},
            ["batch size 0"],
        ),
        (
            {"shape": [1, 28, 28], "datatype": "UINT8"},
            ["no 'data'"],
        ),
    ],
    ids=["count", "uint8-range", "uint8-fraction", "string", "too-many", "empty", "no-data"],
)
def test_bad_tensor_data_is_400_naming_the_problem(http, tensor, fragments):
    body = {"inputs": [{"name": "images", **tensor}]}
    response = http.post(f"/v2/models/{MODEL_NAME}/infer", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert list(error) == ["error"] and isinstance(error["error"], str)
    for fragment in fragments:
        assert fragment in error["error"], (fragment, error["error"])


def test_bad_binary_framing_is_400(http):
    header = (
        b'{"parameters":{"binary_data_output":true},"inputs":[{"name":"images","shape":[1,28,28],'
        b'"datatype":"UINT8","parameters":{"binary_data_size":784}}]}'
    )
    path = f"/v2/models/{MODEL_NAME}/infer"
    short = http.post(
        path,
        content=header + bytes(700),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert short.status_code == 400
    assert "700 bytes of binary tensor data" in short.json()["error"]
    good = http.post(
        path,
        content=header + bytes(784),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert good.status_code == 200, good.text
    assert good.headers["content-type"] == "application/octet-stream"
    json_length = int(good.headers["inference-header-content-length"])
    outputs = httpx.Response(200, content=good.content[:json_length]).json()["outputs"]
    sizes = [o["parameters"]["binary_data_size"] for o in outputs]
    assert sizes == [40, 40] and len(good.content) == json_length + 80
    not_json = http.post(path, content=b"{not json")
    assert not_json.status_code == 400
    assert "invalid inference request" in not_json.json()["error"]


# --- API key -------------------------------------------------------------------------------------------


def test_api_key_guards_models_but_not_health(
    model_repository, tmp_path, onnx_reference, fashion_images
):
    with (
        running_server(
            model_repository, tmp_path / "service.log", suite=INTEROP, api_key="interop-key"
        ) as keyed,
        triton.InferenceServerClient(keyed.url.removeprefix("http://")) as client,
    ):
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["name"] == "vitserve"
        assert not client.is_model_ready(MODEL_NAME)
        with pytest.raises(InferenceServerException) as error:
            client.get_model_metadata(MODEL_NAME)
        assert_oip_error(error, 401, "API key")
        with pytest.raises(InferenceServerException) as error:
            client.infer(MODEL_NAME, [fp32_input(fashion_images[:1], onnx_reference)])
        assert_oip_error(error, 401, "Authorization: Bearer")
        wrong = {"Authorization": "Bearer nope"}
        with pytest.raises(InferenceServerException) as error:
            client.infer(
                MODEL_NAME, [fp32_input(fashion_images[:1], onnx_reference)], headers=wrong
            )
        assert_oip_error(error, 401, "not valid")
        good = {"Authorization": "Bearer interop-key"}
        assert client.is_model_ready(MODEL_NAME, headers=good)
        assert client.get_model_metadata(MODEL_NAME, headers=good)["name"] == MODEL_NAME
        image = fashion_images[:1]
        result = client.infer(MODEL_NAME, [fp32_input(image, onnx_reference)], headers=good)
        expected = onnx_reference.logits(onnx_reference.normalise(image))
        np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4, atol=1e-4)


# --- the documented client ---------------------------------------------------------------------------


def documented_client_code() -> str:
    """The Python block of docs/scaling-out.md (README's "Scaling out" section points there)."""
    text = (REPO / "docs" / "scaling-out.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    if blocks:
        return blocks[0]
    raise AssertionError("no Python block in docs/scaling-out.md")


def test_the_documented_client_code_works_against_vitserve(
    server, onnx_reference, model_repository, fashion_images
):
    namespace: dict = {}
    exec(compile(documented_client_code(), "scaling-out", "exec"), namespace)
    images = fashion_images[:4]
    rows = namespace["classify"](server.url.removeprefix("http://"), MODEL_NAME, images)
    logits = onnx_reference.logits(onnx_reference.normalise(images))
    labels = (model_repository / MODEL_NAME / "1" / "labels.txt").read_text().splitlines()
    assert len(rows) == 4 and all(len(row) == 3 for row in rows)
    for row, expected in zip(rows, logits, strict=True):
        top = np.argsort(-expected, kind="stable")[:3].tolist()
        assert [entry.split(":", 2)[1:] for entry in row] == [[str(i), labels[i]] for i in top]
