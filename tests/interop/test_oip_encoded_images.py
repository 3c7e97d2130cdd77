"""Image files over the Open Inference Protocol (the BYTES input ``image``), sent by Triton's own clients.

``tritonclient.http`` (binary tensor data, and JSON with base64 strings) and ``tritonclient.grpc``
(``raw_input_contents``, and ``bytes_contents`` through the raw stub) send a PNG and a JPEG; every answer
must equal ``/predict``'s on the same files, which decodes them with the same code, and every malformed
file or tensor must get a 4xx that names the element, over each transport.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image, ImageDraw
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.frontend import serving
from service.frontend.oip.grpc_service import code_name
from tests.interop.eco_support import eco_app
from tests.support import MODEL_NAME, Server, metric

pytestmark = pytest.mark.timeout(300)


def drawn_image(size: tuple[int, int]) -> Image.Image:
    """A light garment-like shape on a dark ground, larger than the model's input and not square,
    so that decoding, fit-pad and the polarity check all have work to do."""
    image = Image.new("RGB", size, (12, 16, 20))
    draw = ImageDraw.Draw(image)
    width, height = size
    draw.rectangle((width // 4, height // 6, 3 * width // 4, 5 * height // 6), fill=(220, 200, 180))
    draw.ellipse((width // 3, height // 3, 2 * width // 3, height // 2), fill=(40, 90, 160))
    return image


def encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **({"quality": 90} if image_format == "JPEG" else {}))
    return buffer.getvalue()


PNG = encoded(drawn_image((60, 44)), "PNG")
JPEG = encoded(drawn_image((40, 64)).rotate(20), "JPEG")
FILES = [PNG, JPEG]


@pytest.fixture(scope="module")
def server(served) -> Server:
    """The server of ``served``, for the suite's ``http`` client."""
    return served[0]


@pytest.fixture(scope="module")
def http_client(served) -> Iterator[triton_http.InferenceServerClient]:
    with triton_http.InferenceServerClient(served[0].url.removeprefix("http://")) as client:
        yield client


@pytest.fixture(scope="module")
def predicted(http: httpx.Client) -> np.ndarray:
    """``/predict``'s probabilities for FILES (multipart, the service's defaults), [files, classes]."""
    files = [("files", (f"f{i}", data)) for i, data in enumerate(FILES)]
    response = http.post("/predict", files=files, data={"top_k": "10"})
    assert response.status_code == 200, response.text
    rows = []
    for prediction in response.json()["predictions"]:
        scores = {entry["index"]: entry["score"] for entry in prediction["top_k"]}
        rows.append([scores[i] for i in range(len(scores))])
    return np.asarray(rows)


def http_input(elements: list, binary: bool) -> triton_http.InferInput:
    infer_input = triton_http.InferInput("image", [len(elements), 1], "BYTES")
    infer_input.set_data_from_numpy(np.array(elements, dtype=object).reshape(-1, 1), binary)
    return infer_input


def assert_equal_to_predict(probabilities: np.ndarray, predicted: np.ndarray) -> None:
    assert probabilities.shape == predicted.shape
    np.testing.assert_allclose(probabilities, predicted, rtol=0, atol=1e-6)
    assert predicted.max(axis=1).min() > 0.0  # a real answer, not an empty one


def test_the_metadata_declares_only_the_graph_s_tensor(http_client):
    """Generic clients (perf_analyzer) fill every input the metadata lists: the files' input is
    served, not declared (docs/decisions.md#encoded-image-input-undeclared)."""
    inputs = http_client.get_model_metadata(MODEL_NAME)["inputs"]
    assert [tensor["name"] for tensor in inputs] == ["images"]
    assert [tensor["name"] for tensor in http_client.get_model_config(MODEL_NAME)["input"]] == [
        "images"
    ]


def test_tritonclient_http_sends_files_as_binary_tensor_data(http_client, predicted):
    result = http_client.infer(MODEL_NAME, [http_input(FILES, binary=True)])
    assert_equal_to_predict(result.as_numpy("probabilities"), predicted)


def test_tritonclient_http_sends_base64_files_in_json(http_client, predicted):
    """JSON carries a file as a base64 string: what tritonclient sends for ``binary_data=False``."""
    strings = [base64.b64encode(data) for data in FILES]
    result = http_client.infer(MODEL_NAME, [http_input(strings, binary=False)])
    assert_equal_to_predict(result.as_numpy("probabilities"), predicted)


def test_plain_json_of_shape_n_with_the_base64_content_type(http, predicted):
    """KServe's and MLServer's way: shape [N], ``parameters.content_type`` "base64"."""
    body = {
        "inputs": [
            {
                "name": "image",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"content_type": "base64"},
                "data": [base64.b64encode(data).decode() for data in FILES],
            }
        ],
        "outputs": [{"name": "probabilities"}],
    }
    response = http.post(f"/v2/models/{MODEL_NAME}/infer", json=body)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    probabilities = np.asarray(output["data"]).reshape(output["shape"])
    assert_equal_to_predict(probabilities, predicted)


def test_tritonclient_grpc_sends_files_as_raw_contents(grpc_client, predicted):
    infer_input = triton_grpc.InferInput("image", [2, 1], "BYTES")
    infer_input.set_data_from_numpy(np.array(FILES, dtype=object).reshape(-1, 1))
    result = grpc_client.infer(MODEL_NAME, [infer_input])
    assert_equal_to_predict(result.as_numpy("probabilities"), predicted)


def test_grpc_bytes_contents(stub, predicted):
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    tensor = request.inputs.add(name="image", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(FILES)
    request.outputs.add(name="probabilities")
    response = stub.ModelInfer(request)
    probabilities = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, -1)
    assert_equal_to_predict(probabilities, predicted)


# --- what is refused, over each transport ---------------------------------------------------------

NOT_AN_IMAGE = b"this is not an image file"


def test_http_binary_not_an_image_is_400_naming_the_element(http_client):
    """/predict's 422 for the same file; the protocol has no 422 (service/frontend/error_responses.py)."""
    with pytest.raises(InferenceServerException) as error:
        http_client.infer(MODEL_NAME, [http_input([PNG, NOT_AN_IMAGE], binary=True)])
    assert error.value.status() == "400"
    assert "input 'image'[1]: not a recognisable image" in error.value.message()


def test_http_json_bad_base64_is_400(http_client):
    with pytest.raises(InferenceServerException) as error:
        http_client.infer(MODEL_NAME, [http_input(["not base64!"], binary=False)])
    assert error.value.status() == "400"
    assert "input 'image'[0].b64: not valid base64" in error.value.message()


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"name": "image", "shape": [1, 1], "datatype": "BYTES", "data": [[7]]},
            400,
            "input 'image'[0]: 7 is not a string",
        ),
        (
            {"name": "image", "shape": [2], "datatype": "BYTES", "data": ["aGk="]},
            400,
            "'data' holds 1 elements; its shape needs 2",
        ),
        (
            {"name": "image", "shape": [1, 2], "datatype": "BYTES", "data": ["aGk=", "aGk="]},
            400,
            "shape [1, 2] is neither [N] nor [N, 1]",
        ),
        (
            {"name": "image", "shape": [1], "datatype": "FP32", "data": [1.0]},
            400,
            "'image' takes BYTES",
        ),
        (
            {"name": "images", "shape": [1], "datatype": "BYTES", "data": ["aGk="]},
            400,
            "send them as input 'image'",
        ),
        (
            {
                "name": "image",
                "shape": [1],
                "datatype": "BYTES",
                "parameters": {"content_type": "str"},
                "data": ["aGk="],
            },
            400,
            'content_type is "str"',
        ),
    ],
)
def test_http_json_malformed_tensors_are_refused(http, body, status, fragment):
    response = http.post(f"/v2/models/{MODEL_NAME}/infer", json={"inputs": [body]})
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]


def test_http_binary_truncated_element_is_400(http):
    data = len(PNG).to_bytes(4, "little") + PNG[:-10]
    header = (
        b'{"inputs":[{"name":"image","shape":[1,1],"datatype":"BYTES",'
        b'"parameters":{"binary_data_size":' + str(len(data)).encode() + b"}}]}"
    )
    response = http.post(
        f"/v2/models/{MODEL_NAME}/infer",
        content=header + data,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 400, response.text
    assert f"element 0 declares {len(PNG)} bytes" in response.json()["error"]


def test_grpc_not_an_image_is_invalid_argument(grpc_client):
    infer_input = triton_grpc.InferInput("image", [1, 1], "BYTES")
    infer_input.set_data_from_numpy(np.array([[NOT_AN_IMAGE]], dtype=object))
    with pytest.raises(InferenceServerException) as error:
        grpc_client.infer(MODEL_NAME, [infer_input])
    assert error.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "input 'image'[0]: not a recognisable image" in error.value.message()


def test_grpc_serialized_elements_must_fill_the_contents(stub):
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(PNG).to_bytes(4, "little") + PNG + b"extra")
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 5 bytes after its 1 elements" in error.value.details()


@pytest.mark.parametrize("over", [0, 1])
def test_a_bytes_request_of_exactly_max_body_bytes_is_served_and_one_byte_more_is_413(
    model_repository, predicted, over
):
    """The body limit is inclusive: a request of image files whose body is exactly max_body_bytes
    long is served (the same answer as /predict), one of a byte more is 413 naming the limit."""
    files = b"".join(len(data).to_bytes(4, "little") + data for data in FILES)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [2, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(files)},
                }
            ]
        }
    ).encode()
    body = header + files
    with eco_app(model_repository, grpc=False, max_body_bytes=len(body) - over) as client:
        response = client.post(
            f"/v2/models/{MODEL_NAME}/infer",
            content=body,
            headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )
    if over:
        assert response.status_code == 413, response.text
        assert f"max_body_bytes={len(body) - 1}" in response.json()["error"]
        return
    assert response.status_code == 200, response.text
    outputs = {output["name"]: output for output in response.json()["outputs"]}
    probabilities = np.array(outputs["probabilities"]["data"], np.float32).reshape(2, -1)
    assert_equal_to_predict(probabilities, predicted)


def noise_png(side: int) -> bytes:
    """An RGB PNG of noise: it does not compress, so a gRPC call that carries it is larger than
    INLINE_TENSOR_BYTES, and its pixels more than INLINE_PIXELS (both decoded in a thread)."""
    pixels = np.random.default_rng(7).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels), "PNG")


def test_a_grpc_call_of_image_files_is_admitted_and_decoded_once_and_counted(
    model_repository, monkeypatch
):
    """The gRPC codec hands the files over as a value: the call is admitted once, for its images,
    and decoded in one thread hop (it was admitted as a tensor call, sent to a thread that found the
    files and raised them, then admitted and decoded again). Every gRPC call is counted in
    /metrics under the gRPC ecosystem's names, by method and status code."""
    large = noise_png(200)
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="image", datatype="BYTES", shape=[2])
    request.inputs[0].contents.bytes_contents.extend([large, PNG])
    assert request.ByteSize() > serving.INLINE_TENSOR_BYTES
    bad = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    bad.inputs.add(name="image", datatype="BYTES", shape=[1])
    bad.inputs[0].contents.bytes_contents.append(NOT_AN_IMAGE)
    hops, admitted = [], []
    run_in_threadpool = serving.run_in_threadpool

    async def counted(function, *args):
        hops.append(function)
        return await run_in_threadpool(function, *args)

    monkeypatch.setattr(serving, "run_in_threadpool", counted)
    with eco_app(model_repository) as client:
        engine = client.app.state.frontend.engine
        admit = engine.admit

        def counted_admit(view, requested, graph, count):
            admitted.append(count)
            admit(view, requested, graph, count)

        monkeypatch.setattr(engine, "admit", counted_admit)
        port = client.app.state.settings.server.grpc_port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            response = stub.ModelInfer(request)
            assert admitted == [2] and len(hops) == 1  # once, for its two images; one hop
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(bad)
            assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
        metrics = client.get("/metrics").text
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [list(output.shape) for output in response.outputs] == [[2, 10], [2, 10]]
    call = {"grpc_service": "inference.GRPCInferenceService", "grpc_type": "unary"}
    handled = "grpc_server_handled_total"
    assert metric(metrics, handled, grpc_method="ModelInfer", grpc_code="OK", **call) == 1
    assert metric(metrics, handled, grpc_method="ModelInfer", grpc_code="InvalidArgument") == 1
    assert metric(metrics, handled, grpc_method="ServerLive", grpc_code="OK", **call) == 1
    count = "grpc_server_handling_seconds_count"
    assert metric(metrics, count, grpc_method="ModelInfer", **call) == 2
    # beside HTTP's series, never in them
    assert metric(metrics, "vitserve_http_requests_total", route="ModelInfer") == 0


def test_grpc_codes_are_spelled_as_go_grpc_prometheus_spells_them():
    assert [
        code_name(code)
        for code in (
            grpc.StatusCode.OK,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNAUTHENTICATED,
        )
    ] == ["OK", "InvalidArgument", "Canceled", "DeadlineExceeded", "Unauthenticated"]
