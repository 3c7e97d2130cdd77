"""The Open Inference Protocol codec against byte-level fixtures written from the specification.

What the bytes must be, from the KServe v2 protocol and Triton's binary tensor data extension
(docs/protocol/extension_binary_data.md):

- the body is the JSON header, then each binary tensor's bytes in the order the tensors appear; the
  ``Inference-Header-Content-Length`` header gives the JSON header's length in bytes;
- a binary input or output declares its byte count in ``parameters.binary_data_size``;
- FP32 elements are IEEE 754 single precision, little-endian; UINT8 are one byte each, row-major;
- a BYTES element is a 4-byte little-endian unsigned length, then that many bytes.

The fixtures below are literal bytes (1.0 is ``00 00 80 3f``, -2.5 is ``00 00 20 c0``), not produced
by numpy or the codec, so that a byte order or length prefix changed in the codec fails here even
though an encoder and decoder changed together would still agree with each other.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from service.contract.model_repository import ModelMetadata
from service.frontend.oip import codec, grpc_codec
from service.frontend.oip.encoded import EncodedImages
from tests.support import SPEC, Reference

ELEMENTS = 28 * 28

# Four FP32 values and their little-endian bytes, written out by hand.
FP32_LE = {
    1.0: b"\x00\x00\x80\x3f",
    -2.5: b"\x00\x00\x20\xc0",
    0.15625: b"\x00\x00\x20\x3e",
    0.0: b"\x00\x00\x00\x00",
}
PATTERN = [1.0, -2.5, 0.15625, 0.0]


@pytest.fixture(scope="module")
def meta(reference: Reference) -> ModelMetadata:
    document = reference.classifier.get_modelmeta().custom_metadata_map["vitserve"]
    return ModelMetadata.model_validate_json(document)


def fp32_image() -> tuple[bytes, np.ndarray]:
    """One 1 x 28 x 28 FP32 image as the wire carries it, and the values it stands for."""
    values = [PATTERN[i % 4] for i in range(ELEMENTS)]
    return b"".join(FP32_LE[v] for v in values), np.array(values).reshape(1, 1, 28, 28)


def binary_request(datatype: str, raw: bytes, **extra: object) -> tuple[bytes, str]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "shape": [1, 1, 28, 28],
                    "datatype": datatype,
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            **extra,
        }
    ).encode()
    return header + raw, str(len(header))


def test_binary_fp32_input_is_read_little_endian(meta):
    raw, values = fp32_image()
    assert raw[:8] == b"\x00\x00\x80\x3f\x00\x00\x20\xc0"
    body, length = binary_request("FP32", raw)
    _, decoded = codec.decode_request(body, length, meta, max_images=8)
    np.testing.assert_array_equal(decoded.batch, values)  # FP32 reaches the model untouched


def test_binary_uint8_input_is_one_byte_per_pixel_row_major_then_normalised(meta):
    raw = bytes(i % 256 for i in range(ELEMENTS))  # row 0: 0, 1, ..., 27; row 1: 28, ...
    body, length = binary_request("UINT8", raw)
    _, decoded = codec.decode_request(body, length, meta, max_images=8)
    assert decoded.batch[0, 0, 0, 27] == pytest.approx((27 / 255 - SPEC.mean[0]) / SPEC.std[0])
    assert decoded.batch[0, 0, 1, 0] == pytest.approx((28 / 255 - SPEC.mean[0]) / SPEC.std[0])
    assert decoded.batch[0, 0, 9, 4] == pytest.approx((0 / 255 - SPEC.mean[0]) / SPEC.std[0])


def test_the_header_length_splits_json_from_tensor_bytes(meta):
    """A header length one byte short leaves the JSON cut: the length counts the JSON exactly."""
    raw, _ = fp32_image()
    body, length = binary_request("FP32", raw)
    with pytest.raises(codec.OipError):
        codec.decode_request(body, str(int(length) - 1), meta, max_images=8)


LOGITS = np.array([[1.0, -2.5, 0.15625, 0.0, 1.0, 1.0, 0.0, 0.0, -2.5, 0.15625]], np.float32)
LOGITS_LE = b"".join(
    FP32_LE[v] for v in [1.0, -2.5, 0.15625, 0.0, 1.0, 1.0, 0.0, 0.0, -2.5, 0.15625]
)


def decoded_for(meta: ModelMetadata, outputs: list[dict], binary_default: bool = False):
    raw, _ = fp32_image()
    extra: dict[str, object] = {"outputs": outputs}
    if binary_default:
        extra["parameters"] = {"binary_data_output": True}
    body, length = binary_request("FP32", raw, **extra)
    return codec.decode_request(body, length, meta, max_images=8)


def test_a_binary_fp32_output_is_json_then_little_endian_bytes(meta):
    infer, decoded = decoded_for(meta, [{"name": "logits", "parameters": {"binary_data": True}}])
    response = codec.encode_response(infer, decoded.outputs, LOGITS, meta, "tiny-vit", "1")
    length = int(response.headers["inference-header-content-length"])
    header, tail = response.body[:length], response.body[length:]
    assert json.loads(header)["outputs"] == [
        {
            "name": "logits",
            "datatype": "FP32",
            "shape": [1, 10],
            "parameters": {"binary_data_size": 40},
        }
    ]
    assert tail == LOGITS_LE
    assert response.media_type == "application/octet-stream"


def test_binary_outputs_follow_the_header_in_the_order_requested(meta):
    infer, decoded = decoded_for(
        meta, [{"name": "probabilities"}, {"name": "logits"}], binary_default=True
    )
    response = codec.encode_response(infer, decoded.outputs, LOGITS, meta, "tiny-vit", "1")
    length = int(response.headers["inference-header-content-length"])
    outputs = json.loads(response.body[:length])["outputs"]
    assert [(o["name"], o["parameters"]["binary_data_size"]) for o in outputs] == [
        ("probabilities", 40),
        ("logits", 40),
    ]
    assert response.body[length + 40 :] == LOGITS_LE
    probabilities = np.frombuffer(response.body[length : length + 40], dtype="<f4")
    exponentials = np.exp(LOGITS[0].astype(np.float64) - 1.0)
    np.testing.assert_allclose(probabilities, exponentials / exponentials.sum(), rtol=1e-6)


def test_a_bytes_output_is_length_prefixed_little_endian(meta):
    """Classification: BYTES elements "<value>:<index>:<label>", best first; on the wire each is a
    4-byte little-endian length and then its UTF-8 bytes."""
    infer, decoded = decoded_for(
        meta, [{"name": "logits", "parameters": {"classification": 2, "binary_data": True}}]
    )
    response = codec.encode_response(infer, decoded.outputs, LOGITS, meta, "tiny-vit", "1")
    length = int(response.headers["inference-header-content-length"])
    first = b"1.000000:0:T-shirt/top"
    second = b"1.000000:4:Coat"
    expected = b"\x16\x00\x00\x00" + first + b"\x0f\x00\x00\x00" + second
    assert (len(first), len(second)) == (0x16, 0x0F)
    assert response.body[length:] == expected
    (output,) = json.loads(response.body[:length])["outputs"]
    assert output["datatype"] == "BYTES" and output["shape"] == [1, 2]
    assert output["parameters"] == {"binary_data_size": len(expected)}


def test_a_json_output_lists_the_values_row_major(meta):
    infer, decoded = decoded_for(meta, [{"name": "logits"}])
    response = codec.encode_response(infer, decoded.outputs, LOGITS, meta, "tiny-vit", "1")
    assert "inference-header-content-length" not in response.headers
    (output,) = json.loads(response.body)["outputs"]
    assert output["data"] == [1.0, -2.5, 0.15625, 0.0, 1.0, 1.0, 0.0, 0.0, -2.5, 0.15625]


def test_grpc_raw_input_contents_are_little_endian(meta):
    raw, values = fp32_image()
    request = service_pb2.ModelInferRequest(model_name="tiny-vit")
    request.inputs.add(name="images", datatype="FP32", shape=[1, 1, 28, 28])
    request.raw_input_contents.append(raw)
    decoded = grpc_codec.decode_infer_request(request, meta, max_images=8)
    np.testing.assert_array_equal(decoded.batch, values)


def test_grpc_raw_output_contents_are_little_endian_and_length_prefixed(meta):
    raw, _ = fp32_image()
    request = service_pb2.ModelInferRequest(model_name="tiny-vit", id="7")
    request.inputs.add(name="images", datatype="FP32", shape=[1, 1, 28, 28])
    request.raw_input_contents.append(raw)
    logits = request.outputs.add(name="logits")
    classes = request.outputs.add(name="probabilities")
    classes.parameters["classification"].int64_param = 1
    decoded = grpc_codec.decode_infer_request(request, meta, max_images=8)
    response = grpc_codec.encode_infer_response(
        request, decoded.outputs, LOGITS, meta, "tiny-vit", "1"
    )
    assert logits.name == "logits" and response.id == "7"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("logits", "FP32", [1, 10]),
        ("probabilities", "BYTES", [1, 1]),
    ]
    assert response.raw_output_contents[0] == LOGITS_LE
    label = response.raw_output_contents[1][4:]
    assert response.raw_output_contents[1][:4] == len(label).to_bytes(4, "little")
    assert label.endswith(b":0:T-shirt/top")  # index 0 wins the tie with 4 and 5: the lower index


# --- image files: BYTES elements in, raised to the HTTP route as EncodedImages ------------------

# Two elements written out by hand: lengths 3 and 0, each a 4-byte little-endian prefix.
SERIALIZED = b"\x03\x00\x00\x00abc" + b"\x00\x00\x00\x00"


def encoded_request(shape: list[int], data: bytes) -> tuple[bytes, str]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": shape,
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    return header + data, str(len(header))


@pytest.mark.parametrize("shape", [[2], [2, 1]])
def test_serialized_bytes_elements_are_split_at_their_length_prefixes(meta, shape):
    body, length = encoded_request(shape, SERIALIZED)
    with pytest.raises(EncodedImages) as raised:
        codec.decode_request(body, length, meta, max_images=8)
    images = raised.value.files.images
    assert [(image.field, image.data) for image in images] == [
        ("input 'image'[0]", b"abc"),
        ("input 'image'[1]", b""),
    ]
    assert [output.name for output in raised.value.files.outputs] == ["logits", "probabilities"]


@pytest.mark.parametrize(
    ("shape", "data", "fragment"),
    [
        ([2, 2], SERIALIZED, "shape [2, 2] is neither [N] nor [N, 1]"),
        ([0], b"", "batch size 0 (shape[0]) must be from 1 to"),
        ([9], SERIALIZED, "batch size 9 (shape[0]) must be from 1 to max_images_per_request=8"),
        ([3], SERIALIZED, "ends after 2 of its 3 elements"),
        ([1], SERIALIZED, "holds 4 bytes after its 1 elements"),
        ([2], SERIALIZED[:-1], "ends after 1 of its 2 elements"),
        (
            [1],
            b"\x05\x00\x00\x00abc",
            "element 0 declares 5 bytes but the binary tensor data holds 3",
        ),
    ],
)
def test_malformed_bytes_tensors_are_refused(meta, shape, data, fragment):
    body, length = encoded_request(shape, data)
    with pytest.raises(codec.OipError) as error:
        codec.decode_request(body, length, meta, max_images=8)
    assert fragment in error.value.message, error.value.message


@pytest.mark.parametrize("count", [8, 9])
def test_a_bytes_input_of_exactly_the_image_limit_is_taken_and_one_more_is_refused(meta, count):
    """max_images_per_request=8 is inclusive: 8 files are taken (none at the limit was tested, so
    a limit of 8 refusing 8 went unseen), 9 are refused naming the limit."""
    data = b"".join(
        len(f"file{i}").to_bytes(4, "little") + f"file{i}".encode() for i in range(count)
    )
    body, length = encoded_request([count, 1], data)
    if count == 9:
        with pytest.raises(codec.OipError) as error:
            codec.decode_request(body, length, meta, max_images=8)
        assert "batch size 9 (shape[0]) must be from 1 to max_images_per_request=8" in str(
            error.value.message
        )
        return
    with pytest.raises(EncodedImages) as raised:
        codec.decode_request(body, length, meta, max_images=8)
    assert [image.data for image in raised.value.files.images] == [
        f"file{i}".encode() for i in range(8)
    ]
