"""Tensors in and out of the Open Inference Protocol's gRPC messages (``ModelInferRequest`` and
``ModelInferResponse`` of Triton's ``service.proto``, as shipped in tritonclient).

The input is checked and normalised by service/frontend/oip/codec.py, as over HTTP: the same datatypes (``FP32``,
``UINT8``), shapes, limits and messages. Its elements come either as ``raw_input_contents`` (little-endian
bytes, what ``tritonclient.grpc`` sends) or as typed ``contents``: ``fp32_contents`` for FP32,
``uint_contents`` for UINT8 (the protocol carries 8-bit integers in 32-bit fields). Outputs are answered
as ``raw_output_contents``, as Triton does; the classification extension is the requested output's
``classification`` parameter. Image files (the BYTES input ``image``, service/frontend/oip/encoded.py)
come serialized in ``raw_input_contents`` or as ``contents.bytes_contents``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from service.contract.model_repository import ModelMetadata
from service.frontend.inputs import RawImage
from service.frontend.oip.codec import (
    Decoded,
    OipError,
    RequestedOutput,
    all_outputs,
    byte_count,
    check_input,
    checked_values,
    output_tensors,
    requested_output,
    to_batch,
    values_from_bytes,
)
from service.frontend.oip.encoded import (
    ImageFiles,
    check_encoded_input,
    images_from_list,
    images_from_serialized,
    is_encoded,
)

_TYPED_FIELD = {"FP32": "fp32_contents", "UINT8": "uint_contents"}
_TYPED_DTYPE = {"FP32": np.float32, "UINT8": np.int64}


def parameter(value: service_pb2.InferParameter) -> Any:
    """An ``InferParameter``'s value, whichever of its fields is set (None when none is)."""
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


def image_files(
    request: service_pb2.ModelInferRequest, meta: ModelMetadata, max_images: int
) -> ImageFiles | None:
    """The image files of a request whose input is the encoded-image one, checked as far as the
    protocol goes (decoding them is ``ServedVersion.classify``'s); None for a tensor request. Cheap
    (the message is parsed already, the files only sliced): the route calls it on the event loop,
    before the request is admitted, so that image files are admitted and decoded once."""
    if not any(is_encoded(t.name, t.datatype) for t in request.inputs):
        return None
    return ImageFiles(request, _images(request, meta, max_images), _outputs(request, meta))


def decode_infer_request(
    request: service_pb2.ModelInferRequest, meta: ModelMetadata, max_images: int
) -> Decoded:
    """Validate a tensor ModelInferRequest (one :func:`image_files` found none in) against the
    model's metadata (blocking: a thread when large)."""
    if not request.inputs:
        raise OipError(f"the request has no inputs; model '{meta.name}' takes '{meta.input.name}'")
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    names = [t.name for t in request.inputs]
    where, elements = check_input(names, tensor.datatype, shape, meta, max_images)
    raw = request.raw_input_contents
    if raw:
        if len(raw) != len(request.inputs):
            raise OipError(
                f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs"
            )
        if tensor.HasField("contents"):
            raise OipError(f"{where}: give either raw_input_contents or contents, not both")
        expected = byte_count(tensor.datatype, elements)
        if len(raw[0]) != expected:
            raise OipError(
                f"{where}: raw_input_contents[0] holds {len(raw[0])} bytes; shape {shape} of "
                f"{tensor.datatype} needs {expected} bytes"
            )
        values = values_from_bytes(raw[0], tensor.datatype, where)
    else:
        field = _TYPED_FIELD[tensor.datatype]
        others = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
        if others:
            raise OipError(
                f"{where}: datatype {tensor.datatype} takes contents.{field}, not "
                f"contents.{others[0]}"
            )
        typed = getattr(tensor.contents, field)
        if len(typed) != elements:
            raise OipError(
                f"{where}: contents.{field} holds {len(typed)} elements; shape {shape} needs "
                f"{elements} (or send raw_input_contents)"
            )
        array = np.asarray(typed, dtype=_TYPED_DTYPE[tensor.datatype])
        values = checked_values(array, tensor.datatype, f"{where}: contents.{field}")
    return Decoded(to_batch(values, tensor.datatype, meta), _outputs(request, meta))


def _images(
    request: service_pb2.ModelInferRequest, meta: ModelMetadata, max_images: int
) -> list[RawImage]:
    """The image files of a request whose input is the encoded-image one: serialized in
    ``raw_input_contents`` (what ``tritonclient.grpc`` sends) or one per ``bytes_contents`` value."""
    tensor = request.inputs[0]
    names = [t.name for t in request.inputs]
    encoded = check_encoded_input(
        names, tensor.datatype, list(tensor.shape), max_images, meta.input.name
    )
    raw = request.raw_input_contents
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != "bytes_contents"]
    if others:
        raise OipError(
            f"{encoded.where}: datatype BYTES takes contents.bytes_contents, not contents.{others[0]}"
        )
    if raw:
        if len(raw) != 1:
            raise OipError(f"raw_input_contents holds {len(raw)} tensors for 1 input")
        if tensor.contents.bytes_contents:
            raise OipError(f"{encoded.where}: give either raw_input_contents or contents, not both")
        return images_from_serialized(raw[0], encoded, "raw_input_contents[0]")
    return images_from_list(
        list(tensor.contents.bytes_contents), encoded, "contents.bytes_contents"
    )


def _outputs(request: service_pb2.ModelInferRequest, meta: ModelMetadata) -> list[RequestedOutput]:
    outputs = [] if request.outputs else all_outputs(meta, True)
    for requested in request.outputs:
        classification = (
            parameter(requested.parameters["classification"])
            if "classification" in requested.parameters
            else None
        )
        outputs.append(requested_output(requested.name, True, classification, meta, outputs))
    return outputs


def encode_infer_response(
    request: service_pb2.ModelInferRequest,
    outputs: list[RequestedOutput],
    logits: np.ndarray,
    meta: ModelMetadata,
    name: str,
    version: str,
) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name=name, model_version=version, id=request.id)
    for _, tensor in output_tensors(outputs, logits, meta):
        response.outputs.add(
            name=tensor.name, datatype=tensor.datatype, shape=list(tensor.values.shape)
        )
        response.raw_output_contents.append(tensor.to_bytes())
    return response
