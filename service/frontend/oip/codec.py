"""Tensors in and out of the Open Inference Protocol: request decoding and response encoding.

A request gives one input: image files as the BYTES input ``image`` (collected by
service/frontend/oip/encoded.py and raised out of HTTP's decoding as ``EncodedImages``, for the route
to decode as /predict does; gRPC's codec returns them as a value before the call is admitted), or the
model's tensor (``images``), in one of two datatypes:

- ``FP32`` ``[N, C, H, W]``: exactly what the ONNX graph takes, already normalised as the metadata says
  (what Triton would be sent for the same ``models/`` directory); it reaches the model untouched.
- ``UINT8`` ``[N, C, H, W]`` (or ``[N, H, W]`` for a one-channel model): raw 0-255 pixels of the model's
  size and polarity; the service scales and normalises them with the metadata's ``scale``, ``mean`` and
  ``std``. No resizing, padding or inversion: send images through ``/predict`` for that.

Outputs: ``logits`` (FP32 ``[N, classes]``, as the graph gives them) and ``probabilities`` (FP32, their
softmax; a vitserve addition, Triton serves ``logits`` only). Every output is returned when none is
requested. Extensions, as Triton implements them: ``binary_tensor_data`` (binary inputs after the JSON
header, ``Inference-Header-Content-Length``; binary outputs with ``binary_data`` or
``binary_data_output``) and ``classification`` (``"classification": k`` on a requested output: BYTES
``[N, k]`` of ``"<value>:<index>:<label>"``, best first). Tensors are validated against the metadata
(name, datatype, shape, element count, values) before anything is queued.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Response
from pydantic import ValidationError

from service.contract.model_config import ENCODED_IMAGE_INPUT
from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import normalise
from service.contract.probabilities import softmax
from service.frontend.error_responses import validation_details, validation_message
from service.frontend.inputs import check_infer_json, parse_header_length
from service.frontend.oip.encoded import encoded_images, is_encoded
from service.frontend.oip.schemas import HEADER_LENGTH, PROBABILITIES, InferRequest, OipError

INPUT_DATATYPES = ("FP32", "UINT8")
_ITEMSIZE = {"FP32": 4, "UINT8": 1}
_NUMPY = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1")}


def _flatten(data: Any, where: str, limit: int) -> list[Any]:
    """``data`` flat or nested (any nesting, row-major) -> one flat list of its scalars."""
    flat: list[Any] = []
    stack = [iter(data)] if isinstance(data, list) else None
    if stack is None:
        raise OipError(f"{where}.data: must be a JSON array (flat or nested) of numbers")
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
            if len(flat) > limit:
                raise OipError(
                    f"{where}.data: holds more than the {limit} elements its shape declares"
                )
        else:
            stack.pop()
    return flat


def _numbers(
    data: Any, header: bytes, elements: int, datatype: str, where: str
) -> np.ndarray | None:
    """``data`` as the datatype's array in one numpy call, when it is a regular (flat or nested)
    list of exactly ``elements`` JSON numbers; None for anything else. A body with no ``true`` or
    ``false`` anywhere holds no booleans (which numpy would take for 1 and 0), and numpy gives a
    number dtype only when every element is a number (strings, nulls, ragged lists, integers past
    64 bits give another dtype or raise)."""
    if b"true" in header or b"false" in header:
        return None
    try:
        array = np.array(data)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.dtype.kind not in "iuf" or array.size != elements:
        return None
    return checked_values(
        array.reshape(-1).astype(np.float64, copy=False), datatype, f"{where}.data"
    )


def _from_json(values: list[Any], datatype: str, where: str) -> np.ndarray:
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OipError(
                f"{where}.data: element {index} is {json.dumps(value)[:40]}, not a number "
                f"(datatype {datatype})"
            )
    try:
        return checked_values(np.asarray(values, dtype=np.float64), datatype, f"{where}.data")
    except OverflowError:
        raise OipError(f"{where}.data: an element is too large for FP32") from None


def checked_values(values: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """Numbers of any numeric dtype -> the datatype's array, once every element is in its range:
    UINT8 integers from 0 to 255, FP32 finite numbers."""
    if datatype == "UINT8":
        if values.dtype == np.uint8:
            return values
        valid = (values >= 0) & (values <= 255) & (np.floor(values) == values)
        if not valid.all():
            index = int(np.argmin(valid))
            shown = values[index].item()
            shown = int(shown) if float(shown).is_integer() else shown
            raise OipError(
                f"{where}: element {index} is {shown}; UINT8 elements are integers from 0 to 255"
            )
        return values.astype(np.uint8)
    finite = np.isfinite(values) & (np.abs(values) <= np.finfo(np.float32).max)
    if not finite.all():
        index = int(np.argmin(finite))
        raise OipError(
            f"{where}: element {index} is {values[index].item()}; FP32 elements must be finite"
        )
    return values.astype(np.float32)


def check_range(values: np.ndarray, meta: ModelMetadata) -> None:
    """FP32 elements within the model's ``input.range`` (a 3e38 is finite, and made NaN logits)."""
    low, high = meta.input_range
    inside = (values >= low) & (values <= high)
    if not inside.all():
        index = int(np.argmin(inside))
        raise OipError(
            f"input '{meta.input.name}': element {index} is {values[index].item():g}; FP32 "
            f"elements must be within the model's input.range [{low:g}, {high:g}]"
        )


def values_from_bytes(raw: bytes, datatype: str, where: str) -> np.ndarray:
    """A tensor's little-endian bytes (binary_tensor_data, gRPC's raw contents) -> its elements."""
    return checked_values(np.frombuffer(raw, dtype=_NUMPY[datatype]), datatype, where)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool
    classification: int | None


@dataclass(frozen=True)
class Decoded:
    batch: np.ndarray  # float32 [N, C, H, W], what the graph takes
    outputs: list[RequestedOutput]


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str  # FP32, or BYTES for the classification extension
    values: np.ndarray  # float32, or object (str) for BYTES

    def to_bytes(self) -> bytes:
        """The protocol's raw form: little-endian FP32, or BYTES as 4-byte-length-prefixed UTF-8."""
        if self.datatype == "BYTES":
            encoded = [s.encode("utf-8") for s in self.values.reshape(-1)]
            return b"".join(len(e).to_bytes(4, "little") + e for e in encoded)
        return self.values.astype("<f4").tobytes()


def _bool_parameter(parameters: dict[str, Any] | None, key: str, where: str) -> bool | None:
    value = (parameters or {}).get(key)
    if value is not None and not isinstance(value, bool):
        raise OipError(f"{where}.parameters.{key}: must be true or false, not {json.dumps(value)}")
    return value


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data after it (binary_tensor_data extension)."""
    if header_length is None:
        return body, b""
    length = parse_header_length(header_length, len(body))
    return body[:length], body[length:]


def check_input(
    names: list[str], datatype: str, shape: list[int], meta: ModelMetadata, max_images: int
) -> tuple[str, int]:
    """The request's input names, and its one tensor's datatype and shape, against the model (every
    transport); returns how to name the tensor in a message, and its element count."""
    spec = meta.input
    unexpected = [name for name in names if name != spec.name]
    if unexpected:
        raise OipError(
            f"unexpected inference input '{unexpected[0]}' for model '{meta.name}': its inputs are "
            f"'{spec.name}' (FP32 or UINT8) and '{ENCODED_IMAGE_INPUT}' (BYTES, image files)"
        )
    if len(names) > 1:
        raise OipError(f"input '{spec.name}' is given {len(names)} times; give it once")
    where = f"input '{spec.name}'"
    if datatype not in INPUT_DATATYPES:
        raise OipError(
            f"{where}: datatype {datatype} is not accepted; send FP32 (normalised, as the model "
            f"takes it) or UINT8 (raw 0-255 pixels, normalised here), or image files as input "
            f"'{ENCODED_IMAGE_INPUT}' (BYTES)"
        )
    model_dims = [spec.channels, spec.height, spec.width]
    allowed = [[-1, *model_dims]]
    if datatype == "UINT8" and spec.channels == 1:
        allowed.append([-1, spec.height, spec.width])
    if len(shape) not in (len(s) for s in allowed) or not any(
        shape[1:] == s[1:] for s in allowed if len(s) == len(shape)
    ):
        shown = " or ".join(str(s).replace("-1", "N") for s in allowed)
        raise OipError(
            f"{where}: shape {shape} does not match the model's {shown} for datatype {datatype}"
        )
    if not 1 <= shape[0] <= max_images:
        raise OipError(
            f"{where}: batch size {shape[0]} (shape[0]) must be from 1 to "
            f"max_images_per_request={max_images}"
        )
    return where, math.prod(shape)


def byte_count(datatype: str, elements: int) -> int:
    return elements * _ITEMSIZE[datatype]


def to_batch(values: np.ndarray, datatype: str, meta: ModelMetadata) -> np.ndarray:
    """Checked elements -> the float32 ``[N, C, H, W]`` the graph takes (UINT8 normalised here)."""
    spec = meta.input
    batch = values.reshape(-1, spec.channels, spec.height, spec.width)
    if datatype == "UINT8":
        batch = normalise(batch, meta.preprocessing)
    else:
        check_range(values, meta)
    return np.ascontiguousarray(batch, dtype=np.float32)


def decode_request(
    body: bytes,
    header_length: str | None,
    meta: ModelMetadata,
    max_images: int,
    max_values: int | None = None,
) -> tuple[InferRequest, Decoded]:
    """Parse and validate the whole request against the model's metadata (blocking: a thread)."""
    header, binary = _split_body(body, header_length)
    spec = meta.input
    check_infer_json(
        header,
        max_images=max_images,
        image_elements=spec.channels * spec.height * spec.width,
        max_values=max_values,
    )
    try:
        infer = InferRequest.model_validate_json(header)
    except ValidationError as error:
        details = validation_details(error.errors(include_url=False))
        raise OipError(f"invalid inference request: {validation_message(details)}") from None
    tensor = infer.inputs[0]
    names = [t.name for t in infer.inputs]
    if any(is_encoded(t.name, t.datatype) for t in infer.inputs):
        raise encoded_images(
            infer, binary, meta.input.name, max_images, _requested_outputs(infer, meta)
        )
    where, elements = check_input(names, tensor.datatype, tensor.shape, meta, max_images)
    shape = tensor.shape
    binary_size = (tensor.parameters or {}).get("binary_data_size")
    if binary_size is not None:
        if tensor.data is not None:
            raise OipError(f"{where}: give either 'data' or parameters.binary_data_size, not both")
        expected = byte_count(tensor.datatype, elements)
        if not isinstance(binary_size, int) or binary_size != expected:
            raise OipError(
                f"{where}: parameters.binary_data_size is {binary_size}; shape {shape} of "
                f"{tensor.datatype} needs {expected} bytes"
            )
        if len(binary) != binary_size:
            raise OipError(
                f"{where}: the body holds {len(binary)} bytes of binary tensor data after the "
                f"{len(header)}-byte JSON header; binary_data_size says {binary_size}"
            )
        values = values_from_bytes(binary, tensor.datatype, where)
    else:
        if binary:
            raise OipError(
                f"the body holds {len(binary)} bytes after the JSON header but no input declares "
                "parameters.binary_data_size"
            )
        if tensor.data is None:
            raise OipError(f"{where}: no 'data' (nor parameters.binary_data_size)")
        values = _numbers(tensor.data, header, elements, tensor.datatype, where)
        if values is None:  # anything unusual: element by element, to name what is wrong
            flat = _flatten(tensor.data, where, elements)
            if len(flat) != elements:
                raise OipError(
                    f"{where}: 'data' holds {len(flat)} elements; shape {shape} needs {elements}"
                )
            values = _from_json(flat, tensor.datatype, where)
    outputs = _requested_outputs(infer, meta)
    return infer, Decoded(to_batch(values, tensor.datatype, meta), outputs)


def _requested_outputs(infer: InferRequest, meta: ModelMetadata) -> list[RequestedOutput]:
    default_binary = bool(_bool_parameter(infer.parameters, "binary_data_output", "request"))
    if infer.outputs is None:
        return all_outputs(meta, default_binary)
    outputs: list[RequestedOutput] = []
    for requested in infer.outputs:
        where = f"output '{requested.name}'"
        binary_output = _bool_parameter(requested.parameters, "binary_data", where)
        outputs.append(
            requested_output(
                requested.name,
                default_binary if binary_output is None else binary_output,
                (requested.parameters or {}).get("classification"),
                meta,
                outputs,
            )
        )
    return outputs


def all_outputs(meta: ModelMetadata, binary: bool) -> list[RequestedOutput]:
    """Every output, as answered when the request names none."""
    return [RequestedOutput(name, binary, None) for name in (meta.outputs.logits, PROBABILITIES)]


def requested_output(
    name: str,
    binary: bool,
    classification: Any,
    meta: ModelMetadata,
    earlier: list[RequestedOutput],
) -> RequestedOutput:
    """One requested output, checked against the model and the outputs requested before it."""
    known = [meta.outputs.logits, PROBABILITIES]
    where = f"output '{name}'"
    if name not in known:
        raise OipError(
            f"unexpected inference output '{name}' for model '{meta.name}': its outputs are "
            f"{', '.join(repr(n) for n in known)}"
        )
    if any(output.name == name for output in earlier):
        raise OipError(f"{where} is requested more than once")
    if classification is not None and (
        isinstance(classification, bool)
        or not isinstance(classification, int)
        or not 1 <= classification <= meta.num_classes
    ):
        raise OipError(
            f"{where}: parameters.classification is {json.dumps(classification)}; it must be "
            f"a count from 1 to the model's {meta.num_classes} classes"
        )
    return RequestedOutput(name, binary, classification)


# --- response encoding ------------------------------------------------------------------------------


def _classify(values: np.ndarray, count: int, labels: list[str]) -> np.ndarray:
    """Triton's classification extension: ``"<value>:<index>:<label>"``, best first (ties: lower
    index), as an object array ``[N, count]`` of str."""
    order = np.argsort(-values, axis=1, kind="stable")[:, :count]
    return np.array(
        [
            [f"{row[i]:f}:{i}:{labels[i]}" for i in indices]
            for row, indices in zip(values, order, strict=True)
        ],
        dtype=object,
    )


def output_tensors(
    outputs: list[RequestedOutput], logits: np.ndarray, meta: ModelMetadata
) -> list[tuple[RequestedOutput, OutputTensor]]:
    """The requested outputs of a batch's logits, in the order requested (every transport)."""
    tensors = {meta.outputs.logits: logits.astype(np.float32)}
    if any(output.name == PROBABILITIES for output in outputs):
        tensors[PROBABILITIES] = softmax(logits).astype(np.float32)
    answered = []
    for requested in outputs:
        values = tensors[requested.name]
        if requested.classification is not None:
            strings = _classify(values, requested.classification, meta.labels)
            answered.append((requested, OutputTensor(requested.name, "BYTES", strings)))
        else:
            answered.append((requested, OutputTensor(requested.name, "FP32", values)))
    return answered


def encode_response(
    infer: InferRequest,
    requested_outputs: list[RequestedOutput],
    logits: np.ndarray,
    meta: ModelMetadata,
    name: str,
    version: str,
) -> Response:
    response: dict[str, Any] = {"model_name": name, "model_version": version}
    if infer.id is not None:
        response["id"] = infer.id
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for requested, tensor in output_tensors(requested_outputs, logits, meta):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.values.shape),
        }
        if requested.binary:
            chunk = tensor.to_bytes()
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = tensor.values.reshape(-1).tolist()
        outputs.append(entry)
    response["outputs"] = outputs
    header = json.dumps(response, separators=(",", ":")).encode("utf-8")
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(chunks),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )
