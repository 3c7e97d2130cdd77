"""Tensors in and out of the Open Inference Protocol: request decoding and response encoding.

The one input is the model's (``images``), in one of two datatypes:

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

from service.errors import InvalidInput, validation_details, validation_message
from service.json_guard import check_infer_json, parse_header_length
from service.model_repository import ModelMetadata
from service.oip.schemas import HEADER_LENGTH, PROBABILITIES, InferRequest
from service.predictions import softmax
from service.preprocessing import normalise

INPUT_DATATYPES = ("FP32", "UINT8")
_ITEMSIZE = {"FP32": 4, "UINT8": 1}
_NUMPY = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1")}


class OipError(InvalidInput):
    """A request the protocol answers 400."""

    status_code = 400
    code = "bad_request"


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


def _from_json(values: list[Any], datatype: str, where: str) -> np.ndarray:
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OipError(
                f"{where}.data: element {index} is {json.dumps(value)[:40]}, not a number "
                f"(datatype {datatype})"
            )
    if datatype == "UINT8":
        for index, value in enumerate(values):
            if not (isinstance(value, int) or float(value).is_integer()) or not 0 <= value <= 255:
                raise OipError(
                    f"{where}.data: element {index} is {value}; UINT8 elements are integers from 0 "
                    "to 255"
                )
        return np.asarray(values, dtype=np.uint8)
    try:
        array = np.asarray(values, dtype=np.float64)
    except OverflowError:
        raise OipError(f"{where}.data: an element is too large for FP32") from None
    finite = np.isfinite(array) & (np.abs(array) <= np.finfo(np.float32).max)
    if not finite.all():
        index = int(np.argmin(finite))
        raise OipError(
            f"{where}.data: element {index} is {values[index]}; FP32 elements must be finite"
        )
    return array.astype(np.float32)


@dataclass(frozen=True)
class _Output:
    name: str
    binary: bool
    classification: int | None


@dataclass(frozen=True)
class Decoded:
    batch: np.ndarray  # float32 [N, C, H, W], what the graph takes
    outputs: list[_Output]


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
    spec = meta.input
    model_dims = [spec.channels, spec.height, spec.width]
    names = [tensor.name for tensor in infer.inputs]
    unexpected = [name for name in names if name != spec.name]
    if unexpected:
        raise OipError(
            f"unexpected inference input '{unexpected[0]}' for model '{meta.name}': its only input "
            f"is '{spec.name}'"
        )
    if len(names) > 1:
        raise OipError(f"input '{spec.name}' is given {len(names)} times; give it once")
    tensor = infer.inputs[0]
    where = f"input '{spec.name}'"
    if tensor.datatype not in INPUT_DATATYPES:
        raise OipError(
            f"{where}: datatype {tensor.datatype} is not accepted; send FP32 (normalised, as the model "
            "takes it) or UINT8 (raw 0-255 pixels, normalised here)"
        )
    shape = tensor.shape
    allowed = [[-1, *model_dims]]
    if tensor.datatype == "UINT8" and spec.channels == 1:
        allowed.append([-1, spec.height, spec.width])
    if len(shape) not in (len(s) for s in allowed) or not any(
        shape[1:] == s[1:] for s in allowed if len(s) == len(shape)
    ):
        shown = " or ".join(str(s).replace("-1", "N") for s in allowed)
        raise OipError(
            f"{where}: shape {shape} does not match the model's {shown} for datatype {tensor.datatype}"
        )
    count_limit = max_images
    if not 1 <= shape[0] <= count_limit:
        raise OipError(
            f"{where}: batch size {shape[0]} (shape[0]) must be from 1 to "
            f"max_images_per_request={count_limit}"
        )
    elements = math.prod(shape)
    binary_size = (tensor.parameters or {}).get("binary_data_size")
    if binary_size is not None:
        if tensor.data is not None:
            raise OipError(f"{where}: give either 'data' or parameters.binary_data_size, not both")
        expected = elements * _ITEMSIZE[tensor.datatype]
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
        values = np.frombuffer(binary, dtype=_NUMPY[tensor.datatype])
        if tensor.datatype == "FP32" and not np.isfinite(values).all():
            raise OipError(
                f"{where}: element {int(np.argmin(np.isfinite(values)))} is not finite; FP32 "
                "elements must be finite"
            )
    else:
        if binary:
            raise OipError(
                f"the body holds {len(binary)} bytes after the JSON header but no input declares "
                "parameters.binary_data_size"
            )
        if tensor.data is None:
            raise OipError(f"{where}: no 'data' (nor parameters.binary_data_size)")
        flat = _flatten(tensor.data, where, elements)
        if len(flat) != elements:
            raise OipError(
                f"{where}: 'data' holds {len(flat)} elements; shape {shape} needs {elements}"
            )
        values = _from_json(flat, tensor.datatype, where)
    batch = values.reshape(shape[0], *model_dims)
    if tensor.datatype == "UINT8":
        batch = normalise(batch, meta.preprocessing)
    batch = np.ascontiguousarray(batch, dtype=np.float32)
    return infer, Decoded(batch, _requested_outputs(infer, meta))


def _requested_outputs(infer: InferRequest, meta: ModelMetadata) -> list[_Output]:
    default_binary = bool(_bool_parameter(infer.parameters, "binary_data_output", "request"))
    known = [meta.outputs.logits, PROBABILITIES]
    if infer.outputs is None:
        return [_Output(name, default_binary, None) for name in known]
    outputs: list[_Output] = []
    for requested in infer.outputs:
        where = f"output '{requested.name}'"
        if requested.name not in known:
            raise OipError(
                f"unexpected inference output '{requested.name}' for model '{meta.name}': its "
                f"outputs are {', '.join(repr(n) for n in known)}"
            )
        if any(output.name == requested.name for output in outputs):
            raise OipError(f"{where} is requested more than once")
        binary = _bool_parameter(requested.parameters, "binary_data", where)
        classification = (requested.parameters or {}).get("classification")
        if classification is not None and (
            isinstance(classification, bool)
            or not isinstance(classification, int)
            or not 1 <= classification <= meta.num_classes
        ):
            raise OipError(
                f"{where}: parameters.classification is {json.dumps(classification)}; it must be "
                f"a count from 1 to the model's {meta.num_classes} classes"
            )
        outputs.append(
            _Output(requested.name, default_binary if binary is None else binary, classification)
        )
    return outputs


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


def encode_response(
    infer: InferRequest,
    decoded: Decoded,
    logits: np.ndarray,
    meta: ModelMetadata,
    name: str,
    version: str,
) -> Response:
    tensors = {meta.outputs.logits: logits.astype(np.float32)}
    if any(output.name == PROBABILITIES for output in decoded.outputs):
        tensors[PROBABILITIES] = softmax(logits).astype(np.float32)
    response: dict[str, Any] = {"model_name": name, "model_version": version}
    if infer.id is not None:
        response["id"] = infer.id
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for requested in decoded.outputs:
        values = tensors[requested.name]
        entry: dict[str, Any] = {"name": requested.name}
        if requested.classification is not None:
            strings = _classify(values, requested.classification, meta.labels)
            entry.update(datatype="BYTES", shape=list(strings.shape))
            if requested.binary:
                encoded = [s.encode("utf-8") for s in strings.reshape(-1)]
                chunk = b"".join(len(e).to_bytes(4, "little") + e for e in encoded)
            else:
                entry["data"] = strings.reshape(-1).tolist()
        else:
            entry.update(datatype="FP32", shape=list(values.shape))
            if requested.binary:
                chunk = values.astype("<f4").tobytes()
            else:
                entry["data"] = values.reshape(-1).tolist()
        if requested.binary:
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
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
