"""The Open Inference Protocol's JSON objects (KServe v2), as vitserve reads and answers them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.contract.model_config import PLATFORM  # noqa: F401  (the routes name it here)
from service.errors import InvalidInput

SERVER_NAME = "vitserve"
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
]
HEADER_LENGTH = "Inference-Header-Content-Length"
PROBABILITIES = "probabilities"


class OipError(InvalidInput):
    """A request the protocol answers 400."""

    status_code = 400
    code = "bad_request"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestInput(_Lenient):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class RequestOutput(_Lenient):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(_Lenient):
    """``$inference_request``: https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol"""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "id": "42",
                    "inputs": [
                        {
                            "name": "images",
                            "shape": [1, 1, 2, 2],
                            "datatype": "UINT8",
                            "data": [0, 255, 255, 0],
                        }
                    ],
                    "outputs": [{"name": "probabilities"}],
                }
            ]
        },
    )

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class MetadataTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadataResponse(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]


class RepositoryIndexRequest(BaseModel):
    model_config = ConfigDict(strict=True, json_schema_extra={"examples": [{"ready": True}]})

    ready: bool = Field(default=False, description="Only the model versions that are ready.")


class RepositoryLoadRequest(_Lenient):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{}]})

    parameters: dict[str, Any] | None = Field(
        default=None, description="Triton's config and file overrides: not supported (400)."
    )


class RepositoryModel(BaseModel):
    """One entry of Triton's repository index."""

    name: str
    version: str = ""
    state: str = Field(description="READY, UNAVAILABLE, LOADING or UNLOADING.")
    reason: str = ""
