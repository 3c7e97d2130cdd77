"""Request and response models of the HTTP API, with the examples shown in the OpenAPI docs."""

from __future__ import annotations

import json
from itertools import chain
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

Invert = Literal["auto", "always", "never"]
_NUMBERS = frozenset((int,))  # pixels are integers: 12.5 is refused as "12" is

# A 1x1 black PNG, used in the examples.
EXAMPLE_PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
)

_INVERT_DESCRIPTION = (
    "Polarity: the shipped model saw light objects on a dark background. 'auto' inverts an image whose "
    "border is the opposite (e.g. a dark garment photographed on white); 'always' and 'never' override."
)


def with_examples(*examples: dict, **config: Any) -> ConfigDict:
    """A model config whose JSON schema (and so the OpenAPI page) shows ``examples``."""
    return ConfigDict(json_schema_extra={"examples": list(examples)}, **config)


class ImageInput(BaseModel):
    """One image: either an encoded file (base64) or raw pixel values. Give exactly one of the two."""

    model_config = with_examples(
        {"b64": EXAMPLE_PNG_B64}, {"pixels": [[0, 128], [255, 64]]}, extra="forbid"
    )

    b64: str | None = Field(
        default=None,
        description="Base64 of a PNG, JPEG, WebP, BMP or GIF file (a data: URL prefix is accepted).",
    )
    pixels: list[Any] | None = Field(
        default=None,
        description=(
            "Nested list H x W (grayscale) or C x H x W (C = 1 or 3) of integers from 0 to 255 "
            "(JSON integers: fractions, strings and booleans are refused)."
        ),
        json_schema_extra={"items": {"type": "array", "items": {}}},
    )

    @field_validator("pixels")
    @classmethod
    def _numbers_only(cls, pixels: list[Any] | None) -> list[Any] | None:
        found = None if pixels is None else first_non_number(pixels)
        if found is not None:
            position, value = found
            if type(value) is float:
                raise PydanticCustomError(
                    "invalid_pixels",
                    "values must be integers from 0 to 255; found {value} at {position}: not an "
                    "integer",
                    {"value": json.dumps(value)[:40], "position": str(position)},
                )
            raise PydanticCustomError(
                "invalid_pixels",
                "values must be numbers from 0 to 255; found {value} at {position}: not a "
                "number (strings, booleans, null and objects are refused)",
                {"value": json.dumps(value)[:40], "position": str(position)},
            )
        return pixels

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageInput:
        if (self.b64 is None) == (self.pixels is None):
            raise ValueError("give exactly one of 'b64' or 'pixels'")
        return self


def first_non_number(pixels: list[Any]) -> tuple[list[int], Any] | None:
    """The position and value of the first element of a nested list that is neither a list nor a
    JSON integer (a boolean is not one, nor a fraction), in reading order; None when there is none.

    Each level of nesting is checked at once at C speed (the elements' types as a set); only when a
    culprit is there is the list walked in Python to find where."""
    level = pixels
    while level:
        kinds = set(map(type, level))
        if kinds <= _NUMBERS:
            return None
        if not kinds <= _NUMBERS | {list}:
            break
        lists = level if kinds == {list} else [item for item in level if type(item) is list]
        level = list(chain.from_iterable(lists))
    else:
        return None
    found = _find_non_number(pixels)
    return None if found is None else (found[0][::-1], found[1])


def _find_non_number(values: list[Any]) -> tuple[list[int], Any] | None:
    """Depth first, in order; the position comes back innermost index first."""
    for index, value in enumerate(values):
        kind = type(value)
        if kind is list:
            found = _find_non_number(value)
            if found is not None:
                found[0].append(index)
                return found
        elif kind not in _NUMBERS:
            return [index], value
    return None


class PredictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(
        default=5, ge=1, description="How many of the best classes to list per image."
    )
    invert: Invert = Field(default="auto", description=_INVERT_DESCRIPTION)


class PredictRequest(PredictOptions):
    """JSON body of POST /predict."""

    model_config = with_examples(
        {"images": [{"b64": EXAMPLE_PNG_B64}], "top_k": 3},
        {"images": [{"pixels": [[0] * 4] * 4}, {"b64": EXAMPLE_PNG_B64}], "invert": "never"},
        extra="forbid",
    )

    images: list[ImageInput] = Field(
        min_length=1, description="The images to classify, answered in the same order."
    )


class AttentionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["rollout", "raw"] = Field(
        default="rollout",
        description=(
            "'rollout': attention rolled out from the first layer up to 'layer' (head mean, identity "
            "added for the residual path, rows renormalised); 'raw': the attention of 'layer' alone."
        ),
    )
    layer: int | None = Field(
        default=None, ge=0, description="Layer, from 0; the last layer when omitted."
    )
    head: int | None = Field(
        default=None,
        ge=0,
        description="Head, from 0, for method 'raw' only; the mean over the heads when omitted.",
    )
    format: Literal["json", "png"] = Field(
        default="json",
        description="'json': the map as numbers; 'png': the image with the map overlaid as a heatmap.",
    )
    top_k: int = Field(default=5, ge=1, description="How many of the best classes to list.")
    invert: Invert = Field(default="auto", description=_INVERT_DESCRIPTION)


class AttentionRequest(AttentionOptions):
    """JSON body of POST /attention."""

    model_config = with_examples(
        {"image": {"b64": EXAMPLE_PNG_B64}},
        {"image": {"b64": EXAMPLE_PNG_B64}, "method": "raw", "layer": 0, "head": 1},
        {"image": {"b64": EXAMPLE_PNG_B64}, "format": "png"},
        extra="forbid",
    )

    image: ImageInput


class ClassScore(BaseModel):
    label: str = Field(examples=["Trouser"])
    index: int = Field(examples=[1])
    score: float = Field(description="Softmax probability.", examples=[0.98])


class Prediction(ClassScore):
    top_k: list[ClassScore] = Field(description="The best classes, best first.")


class ModelRef(BaseModel):
    name: str = Field(examples=["fashion-mnist-vit"])
    version: int = Field(examples=[1])


_PREDICTION_EXAMPLE = {
    "label": "Trouser",
    "index": 1,
    "score": 0.98,
    "top_k": [
        {"label": "Trouser", "index": 1, "score": 0.98},
        {"label": "Dress", "index": 3, "score": 0.01},
    ],
}


class PredictResponse(BaseModel):
    model_config = with_examples(
        {"model": {"name": "fashion-mnist-vit", "version": 1}, "predictions": [_PREDICTION_EXAMPLE]}
    )

    model: ModelRef
    predictions: list[Prediction] = Field(description="One entry per input image, in order.")


class AttentionResponse(BaseModel):
    model_config = with_examples(
        {
            "model": {"name": "fashion-mnist-vit", "version": 1},
            "prediction": _PREDICTION_EXAMPLE,
            "method": "rollout",
            "layer": 5,
            "head": None,
            "pooling": "mean",
            "grid": [2, 2],
            "inverted": False,
            "map": [[0.0, 0.4], [1.0, 0.7]],
        }
    )

    model: ModelRef
    prediction: Prediction
    method: Literal["rollout", "raw"]
    layer: int = Field(
        description="The layer the map is read at (rollout: the last layer rolled out)."
    )
    head: int | None = Field(description="The head, or null for the mean over heads.")
    pooling: Literal["token", "mean"] = Field(
        description="What the classifier pools: the class token's row, or the mean over token rows."
    )
    grid: tuple[int, int] = Field(description="Patch grid, rows x columns: the shape of 'map'.")
    inverted: bool = Field(description="Whether the image was inverted to the model's polarity.")
    map: list[list[float]] = Field(
        description="Attention per patch, min-max scaled to [0, 1] (a constant map is all zeros)."
    )


class InputInfo(BaseModel):
    name: str
    layout: str
    dtype: str
    channels: int
    height: int
    width: int


class BatchingInfo(BaseModel):
    max_batch_size: int
    preferred_batch_sizes: list[int]
    attention_max_batch_size: int
    max_queue_delay_ms: float
    max_queue_size: int
    request_timeout_s: float
    instance_count: int


class LimitsInfo(BaseModel):
    max_body_bytes: int
    max_images_per_request: int
    max_pixels_per_image: int
    max_pixels_per_request: int
    accepted_formats: list[str]


class VersionInfo(BaseModel):
    version: int
    state: Literal["LOADING", "READY", "UNAVAILABLE", "UNLOADING"]
    reason: str = Field(default="", description="Why a version is not READY.")


class ModelInfo(BaseModel):
    """A model, its versions and their states; the details are those of the version that requests
    without a version go to (the highest READY one), null while none is ready."""

    name: str = Field(examples=["fashion-mnist-vit"])
    default: bool = Field(description="Whether /predict and /attention serve this model.")
    versions: list[VersionInfo]
    version: int | None = Field(examples=[1])
    labels: list[str] | None = None
    input: InputInfo | None = None
    preprocessing: dict[str, Any] | None = None
    attention: bool = Field(default=False, description="Whether /attention is available.")
    grid: tuple[int, int] | None = None
    pooling: str | None = None
    depth: int | None = None
    heads: int | None = None
    precision: str | None = Field(default=None, examples=["fp32", "int8"])
    dataset: str | None = None
    test_accuracy: float | None = None
    provider: str | None = Field(
        default=None,
        description="The onnxruntime execution provider in use.",
        examples=["CPUExecutionProvider"],
    )
    batching: BatchingInfo | None = None
    limits: LimitsInfo


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class Health(BaseModel):
    status: Literal["live", "ready", "starting", "shutting_down", "unavailable"]
    ready: bool


class ErrorDetail(BaseModel):
    code: str = Field(examples=["invalid_input"])
    message: str = Field(examples=["images[0].b64: not valid base64"])
    field: str | None = Field(default=None, examples=["images[0].b64"])
    request_id: str | None = Field(default=None, examples=["3f2c9a6e0b7d4c1e"])
    details: list[dict[str, Any]] | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
