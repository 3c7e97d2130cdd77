"""The protocol codec's checks, called in-process (HTTP and gRPC share them): every malformed tensor
is refused with a 400 that names what is wrong, before anything is queued; valid ones become the
exact batch the graph takes.

The same refusals are checked end to end against a real server in tests/interop/test_oip_tritonclient.py;
these run without a server, so that ``make mutation`` sees them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from service.contract.model_repository import ModelMetadata
from service.frontend.oip import codec, grpc_codec
from tests.support import SPEC, Reference

PIXELS = 28 * 28


@pytest.fixture(scope="module")
def meta(reference: Reference) -> ModelMetadata:
    document = reference.classifier.get_modelmeta().custom_metadata_map["vitserve"]
    return ModelMetadata.model_validate_json(document)


def request(
    data: object = None,
    *,
    shape: list[int] | None = None,
    datatype: str = "UINT8",
    name: str = "images",
    binary: bytes | None = None,
    **extra: object,
) -> tuple[bytes, str | None]:
    tensor: dict[str, object] = {
        "name": name,
        "shape": shape or [1, 28, 28],
        "datatype": datatype,
    }
    if data is not None:
        tensor["data"] = data
    if binary is not None:
        tensor["parameters"] = {"binary_data_size": len(binary)}
    header = json.dumps({"inputs": [tensor], **extra}).encode()
    if binary is None:
        return header, None
    return header + binary, str(len(header))


def decode(meta, body: tuple[bytes, str | None], max_images: int = 8):
    return codec.decode_request(body[0], body[1], meta, max_images=max_images)


def refused(meta, body: tuple[bytes, str | None], *fragments: str, max_images: int = 8) -> str:
    with pytest.raises(codec.OipError) as error:
        decode(meta, body, max_images)
    assert error.value.status_code == 400
    for fragment in fragments:
        assert fragment in error.value.message, (fragment, error.value.message)
    return error.value.message


def zeros() -> list[int]:
    return [0] * PIXELS


def normalised(value: float) -> float:
    return (value / 255 - SPEC.mean[0]) / SPEC.std[0]


# --- what is accepted --------------------------------------------------------------------------------


def test_uint8_data_flat_and_nested_give_the_same_batch(meta):
    flat = [i % 256 for i in range(PIXELS)]
    nested = [flat[row * 28 : (row + 1) * 28] for row in range(28)]
    _, one = decode(meta, request(flat))
    _, other = decode(meta, request([nested]))
    np.testing.assert_array_equal(one.batch, other.batch)
    assert one.batch.shape == (1, 1, 28, 28) and one.batch.dtype == np.float32
    assert one.batch[0, 0, 0, 5] == pytest.approx(normalised(5))


def test_fp32_data_reaches_the_model_unchanged_and_four_dimensional_uint8_too(meta):
    values = [0.5, -1.25] * (PIXELS // 2)
    _, decoded = decode(meta, request(values, datatype="FP32", shape=[1, 1, 28, 28]))
    np.testing.assert_array_equal(decoded.batch.reshape(-1), np.array(values, np.float32))
    _, four = decode(meta, request([255] * PIXELS, shape=[1, 1, 28, 28]))
    assert four.batch[0, 0, 27, 27] == pytest.approx(normalised(255))


def test_two_images_in_one_tensor(meta):
    data = [0] * PIXELS + [255] * PIXELS
    _, decoded = decode(meta, request(data, shape=[2, 28, 28]))
    assert decoded.batch.shape == (2, 1, 28, 28)
    assert decoded.batch[1, 0, 0, 0] == pytest.approx(normalised(255))
    assert decoded.batch[0, 0, 0, 0] == pytest.approx(normalised(0))


def test_every_output_is_answered_when_none_is_requested(meta):
    _, decoded = decode(meta, request(zeros()))
    assert [(o.name, o.binary, o.classification) for o in decoded.outputs] == [
        ("logits", False, None),
        ("probabilities", False, None),
    ]
    body = request(zeros(), parameters={"binary_data_output": True})
    _, binary = decode(meta, body)
    assert [o.binary for o in binary.outputs] == [True, True]


def test_a_requested_output_may_override_the_binary_default(meta):
    outputs = [
        {"name": "probabilities", "parameters": {"binary_data": False}},
        {"name": "logits"},
    ]
    body = request(zeros(), outputs=outputs, parameters={"binary_data_output": True})
    _, decoded = decode(meta, body)
    assert [(o.name, o.binary) for o in decoded.outputs] == [
        ("probabilities", False),
        ("logits", True),
    ]


def test_the_request_id_is_answered_back(meta):
    infer, decoded = decode(meta, request(zeros(), id="abc-1"))
    logits = np.arange(10, dtype=np.float32)[None]
    answer = json.loads(codec.encode_response(infer, decoded.outputs, logits, meta, "m", "1").body)
    assert answer["id"] == "abc-1" and answer["model_name"] == "m"
    assert answer["model_version"] == "1"
    plain, plain_decoded = decode(meta, request(zeros()))
    without = json.loads(
        codec.encode_response(plain, plain_decoded.outputs, logits, meta, "m", "1").body
    )
    assert "id" not in without


def test_classification_ranks_best_first_and_ties_by_index(meta):
    _, decoded = decode(
        meta, request(zeros(), outputs=[{"name": "logits", "parameters": {"classification": 3}}])
    )
    logits = np.array([[0, 2, 0, 0, 0, 2, 0, 0, 0, 3]], np.float32)
    ((_, tensor),) = codec.output_tensors(decoded.outputs, logits, meta)
    assert tensor.datatype == "BYTES"
    assert tensor.values.tolist() == [
        ["3.000000:9:Ankle boot", "2.000000:1:Trouser", "2.000000:5:Sandal"]
    ]


def test_probabilities_are_the_softmax_of_the_logits(meta):
    _, decoded = decode(meta, request(zeros(), outputs=[{"name": "probabilities"}]))
    logits = np.array([[0.0, np.log(3.0)] + [-np.inf] * 8], np.float32)
    ((_, tensor),) = codec.output_tensors(decoded.outputs, logits, meta)
    np.testing.assert_allclose(tensor.values[0, :2], [0.25, 0.75], rtol=1e-6)
    assert tensor.values.dtype == np.float32


# --- what is refused ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (
            {"name": "pixels"},
            [
                "unexpected inference input 'pixels'",
                "its inputs are 'images' (FP32 or UINT8) and 'image' (BYTES",
            ],
        ),
        ({"datatype": "INT32"}, ["datatype INT32 is not accepted", "FP32", "UINT8"]),
        ({"shape": [1, 28, 27]}, ["shape [1, 28, 27] does not match", "[N, 1, 28, 28]"]),
        ({"shape": [1, 1, 28]}, ["shape [1, 1, 28] does not match"]),
        ({"shape": [1, 28, 28], "datatype": "FP32"}, ["does not match the model's [N, 1, 28, 28]"]),
        ({"shape": [0, 28, 28]}, ["batch size 0 (shape[0]) must be from 1 to"]),
        ({"shape": [9, 28, 28]}, ["batch size 9", "max_images_per_request=8"]),
    ],
)
def test_a_tensor_the_model_cannot_take_is_refused(meta, kwargs, fragments):
    """Checked before the data is looked at (none is sent here)."""
    refused(meta, request(**kwargs), *fragments)


def test_the_batch_limit_is_the_one_given(meta):
    refused(meta, request(zeros() * 2, shape=[2, 28, 28]), "max_images_per_request=1", max_images=1)
    decode(meta, request(zeros() * 2, shape=[2, 28, 28]), max_images=2)


def test_an_input_given_twice_is_refused(meta):
    tensor = {"name": "images", "shape": [1, 28, 28], "datatype": "UINT8", "data": zeros()}
    body = json.dumps({"inputs": [tensor, tensor]}).encode()
    refused(meta, (body, None), "input 'images' is given 2 times")


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        (zeros()[:-1], ["'data' holds 783 elements; shape [1, 28, 28] needs 784"]),
        ([*zeros(), 0], ["holds more than the 784 elements its shape declares"]),
        ("zeros", ["must be a JSON array"]),
        ([*zeros()[:-1], "1"], ['element 783 is "1", not a number (datatype UINT8)']),
        ([*zeros()[:-1], True], ["element 783 is true, not a number"]),
        ([*zeros()[:-1], None], ["element 783 is null, not a number"]),
        ([256, *zeros()[1:]], ["element 0 is 256; UINT8 elements are integers from 0 to 255"]),
        ([0, -1, *zeros()[2:]], ["element 1 is -1; UINT8"]),
        ([0, 0, 1.5, *zeros()[3:]], ["element 2 is 1.5; UINT8"]),
    ],
)
def test_bad_uint8_data_is_refused_naming_the_element(meta, data, fragments):
    refused(meta, request(data), "input 'images'", *fragments)


def test_fp32_elements_must_be_finite_and_in_range(meta):
    big = [*[0.0] * (PIXELS - 1), 1e39]
    refused(meta, request(big, datatype="FP32", shape=[1, 1, 28, 28]), "element 783", "finite")
    huge = [*[0.0] * (PIXELS - 1), 10**400]
    refused(meta, request(huge, datatype="FP32", shape=[1, 1, 28, 28]), "too large for FP32")
    nan = np.zeros(PIXELS, "<f4")
    nan[3] = np.nan
    body = request(datatype="FP32", shape=[1, 1, 28, 28], binary=nan.tobytes())
    refused(meta, body, "element 3 is nan; FP32 elements must be finite")


def test_no_data_at_all_is_refused(meta):
    refused(meta, request(), "no 'data' (nor parameters.binary_data_size)")


def test_binary_framing_is_checked(meta):
    raw = bytes(PIXELS)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "shape": [1, 28, 28],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": PIXELS - 1},
                }
            ]
        }
    ).encode()
    refused(
        meta,
        (header + raw, str(len(header))),
        "binary_data_size is 783; shape [1, 28, 28] of UINT8 needs 784 bytes",
    )
    body, length = request(binary=raw)
    refused(meta, (body + b"\x00", length), "holds 785 bytes of binary tensor data", "says 784")
    both = json.loads(body[: int(length)])
    both["inputs"][0]["data"] = zeros()
    header = json.dumps(both).encode()
    refused(meta, (header + raw, str(len(header))), "either 'data' or parameters.binary_data_size")
    plain = request(zeros())[0]
    refused(
        meta,
        (plain + b"\x01\x02", str(len(plain))),
        "holds 2 bytes after the JSON header but no input declares parameters.binary_data_size",
    )


def test_an_invalid_request_document_is_refused(meta):
    refused(meta, (b'{"inputs": "no"}', None), "invalid inference request")


@pytest.mark.parametrize(
    ("outputs", "fragments"),
    [
        (
            [{"name": "scores"}],
            ["unexpected inference output 'scores'", "'logits', 'probabilities'"],
        ),
        ([{"name": "logits"}, {"name": "logits"}], ["output 'logits' is requested more than once"]),
        (
            [{"name": "logits", "parameters": {"classification": 11}}],
            ["parameters.classification is 11", "from 1 to the model's 10 classes"],
        ),
        ([{"name": "logits", "parameters": {"classification": 0}}], ["classification is 0"]),
        ([{"name": "logits", "parameters": {"classification": True}}], ["classification is true"]),
        ([{"name": "logits", "parameters": {"classification": "2"}}], ['classification is "2"']),
        (
            [{"name": "logits", "parameters": {"binary_data": "yes"}}],
            ["output 'logits'.parameters.binary_data: must be true or false, not \"yes\""],
        ),
    ],
)
def test_bad_requested_outputs_are_refused(meta, outputs, fragments):
    refused(meta, request(zeros(), outputs=outputs), *fragments)


def test_a_classification_of_every_class_is_allowed(meta):
    outputs = [{"name": "logits", "parameters": {"classification": 10}}]
    _, decoded = decode(meta, request(zeros(), outputs=outputs))
    assert decoded.outputs[0].classification == 10


def test_the_binary_output_default_must_be_a_boolean(meta):
    body = request(zeros(), parameters={"binary_data_output": 1})
    refused(meta, body, "request.parameters.binary_data_output: must be true or false, not 1")


# --- gRPC ----------------------------------------------------------------------------------------------


def grpc_request(datatype: str = "UINT8", shape=(1, 28, 28)) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="tiny-vit")
    message.inputs.add(name="images", datatype=datatype, shape=list(shape))
    return message


def grpc_refused(meta, message, *fragments: str) -> None:
    with pytest.raises(codec.OipError) as error:
        grpc_codec.decode_infer_request(message, meta, max_images=8)
    for fragment in fragments:
        assert fragment in error.value.message, (fragment, error.value.message)


def test_grpc_typed_contents_are_read_and_checked(meta):
    message = grpc_request()
    message.inputs[0].contents.uint_contents.extend([7] * PIXELS)
    decoded = grpc_codec.decode_infer_request(message, meta, max_images=8)
    assert decoded.batch[0, 0, 3, 3] == pytest.approx(normalised(7))
    assert [(o.name, o.binary) for o in decoded.outputs] == [
        ("logits", True),
        ("probabilities", True),
    ]
    fp32 = grpc_request("FP32", (1, 1, 28, 28))
    fp32.inputs[0].contents.fp32_contents.extend([0.25] * PIXELS)
    assert grpc_codec.decode_infer_request(fp32, meta, 8).batch[0, 0, 0, 0] == 0.25

    wrong_field = grpc_request()
    wrong_field.inputs[0].contents.fp32_contents.extend([0.0] * PIXELS)
    grpc_refused(meta, wrong_field, "datatype UINT8 takes contents.uint_contents", "fp32_contents")
    short = grpc_request()
    short.inputs[0].contents.uint_contents.extend([0] * 10)
    grpc_refused(meta, short, "contents.uint_contents holds 10 elements", "needs 784")
    over = grpc_request()
    over.inputs[0].contents.uint_contents.extend([300] + [0] * (PIXELS - 1))
    grpc_refused(meta, over, "element 0 is 300; UINT8 elements are integers from 0 to 255")


def test_grpc_raw_contents_are_checked(meta):
    grpc_refused(meta, service_pb2.ModelInferRequest(model_name="m"), "the request has no inputs")
    short = grpc_request()
    short.raw_input_contents.append(bytes(10))
    grpc_refused(meta, short, "raw_input_contents[0] holds 10 bytes", "needs 784 bytes")
    twice = grpc_request()
    twice.raw_input_contents.extend([bytes(PIXELS), bytes(PIXELS)])
    grpc_refused(meta, twice, "raw_input_contents holds 2 tensors for 1 inputs")
    both = grpc_request()
    both.raw_input_contents.append(bytes(PIXELS))
    both.inputs[0].contents.uint_contents.extend([0] * PIXELS)
    grpc_refused(meta, both, "either raw_input_contents or contents, not both")


def test_grpc_outputs_and_their_classification(meta):
    message = grpc_request()
    message.raw_input_contents.append(bytes(PIXELS))
    wanted = message.outputs.add(name="logits")
    wanted.parameters["classification"].int64_param = 2
    decoded = grpc_codec.decode_infer_request(message, meta, max_images=8)
    assert [(o.name, o.binary, o.classification) for o in decoded.outputs] == [("logits", True, 2)]
    assert grpc_codec.parameter(service_pb2.InferParameter()) is None
    bad = grpc_request()
    bad.raw_input_contents.append(bytes(PIXELS))
    bad.outputs.add(name="logits").parameters["classification"].int64_param = 0
    grpc_refused(meta, bad, "parameters.classification is 0")


# --- what the mutation run of the codec found unpinned (docs/testing.md) ------------------------------


def test_a_long_non_number_is_quoted_to_40_characters(meta):
    data = [*zeros()[:-1], "x" * 100]
    message = refused(meta, request(data))
    shown = json.dumps("x" * 100)[:40]
    assert f"element 783 is {shown}, not a number" in message


def test_fp32_elements_are_accepted_up_to_the_input_range_and_refused_past_it(meta):
    """The edges of the model's input.range are accepted exactly; the next float past either edge,
    and the largest finite FP32 (finite, but it makes NaN logits), are refused."""
    low, high = meta.input_range
    for edge in (low, high):
        data = [*[0.0] * (PIXELS - 1), float(np.float32(edge))]
        _, decoded = decode(meta, request(data, datatype="FP32", shape=[1, 1, 28, 28]))
        assert decoded.batch[0, 0, 27, 27] == np.float32(edge)
    outside = (
        float(np.nextafter(np.float32(high), np.float32(np.inf))),
        float(np.nextafter(np.float32(low), np.float32(-np.inf))),
        float(np.finfo(np.float32).max),
    )
    for value in outside:
        data = [*[0.0] * (PIXELS - 1), value]
        refused(meta, request(data, datatype="FP32", shape=[1, 1, 28, 28]), "input.range")


def test_a_bad_binary_element_is_named_with_its_input(meta):
    nan = np.zeros(PIXELS, "<f4")
    nan[3] = np.nan
    body = request(datatype="FP32", shape=[1, 1, 28, 28], binary=nan.tobytes())
    refused(meta, body, "input 'images': element 3 is nan")


def test_the_shape_message_shows_every_shape_the_model_takes(meta):
    refused(
        meta,
        request(shape=[1, 28, 27]),
        "shape [1, 28, 27] does not match the model's [N, 1, 28, 28] or [N, 28, 28] for "
        "datatype UINT8",
    )
    refused(meta, request(datatype="INT32"), "UINT8 (raw 0-255 pixels, normalised here)")


def test_the_json_value_limit_applies_when_given(meta):
    from service.errors import ServiceError

    body = request(zeros())
    decode(meta, body)  # no limit given: accepted
    with pytest.raises(ServiceError) as error:
        codec.decode_request(body[0], body[1], meta, max_images=8, max_values=100)
    assert error.value.status_code == 413 and "max_json_values=100" in error.value.message


def test_classification_ties_keep_the_lower_index_among_many_classes():
    """Past 16 elements numpy's default sort is not stable: ties must still go to the lower index."""
    labels = [f"c{i}" for i in range(40)]
    values = np.zeros((1, 40), np.float32)
    values[0, [3, 17, 25, 33]] = 1.0
    ranked = codec._classify(values, 40, labels)[0].tolist()
    assert [entry.split(":")[1] for entry in ranked] == [
        str(i) for i in [3, 17, 25, 33, *[j for j in range(40) if j not in (3, 17, 25, 33)]]
    ]


def test_a_json_answer_says_it_is_json(meta):
    infer, decoded = decode(meta, request(zeros()))
    logits = np.zeros((1, 10), np.float32)
    response = codec.encode_response(infer, decoded.outputs, logits, meta, "m", "1")
    assert response.headers["content-type"] == "application/json"


# --- what the mutation run of grpc_codec.py found unpinned (docs/testing.md) ----------------------


def test_grpc_element_errors_name_the_input_and_its_field(meta):
    typed = grpc_request()
    typed.inputs[0].contents.uint_contents.extend([0, 256] + [0] * (PIXELS - 2))
    grpc_refused(meta, typed, "input 'images': contents.uint_contents: element 1 is 256;")
    raw = grpc_request("FP32", (1, 1, 28, 28))
    values = np.zeros(PIXELS, "<f4")
    values[3] = np.nan
    raw.raw_input_contents.append(values.tobytes())
    with pytest.raises(codec.OipError) as error:
        grpc_codec.decode_infer_request(raw, meta, max_images=8)
    assert error.value.message.startswith("input 'images': element 3 is nan;"), error.value.message


def test_a_grpc_answer_names_the_model_and_version_and_answers_the_id(meta):
    message = grpc_request()
    message.id = "req-7"
    message.raw_input_contents.append(bytes(PIXELS))
    decoded = grpc_codec.decode_infer_request(message, meta, max_images=8)
    logits = np.arange(len(meta.labels), dtype=np.float32)[None, :]
    answer = grpc_codec.encode_infer_response(
        message, decoded.outputs, logits, meta, "tiny-vit", "3"
    )
    assert (answer.model_name, answer.model_version, answer.id) == ("tiny-vit", "3", "req-7")
    assert [output.name for output in answer.outputs] == ["logits", "probabilities"]
    assert list(answer.outputs[0].shape) == [1, len(meta.labels)]
    assert answer.raw_output_contents[0] == logits.astype("<f4").tobytes()
