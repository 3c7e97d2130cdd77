"""POST /predict (the default model), /models/{name}/predict and /models/{name}/versions/{version}/predict:
classify one or more images (JSON or multipart/form-data), answered with their predictions.

``predictions`` turns logits into the API's predictions (softmax, best class, top-k) on a whole batch in
one numpy pass, as plain dicts in the response's JSON shape (the ``Prediction`` schema), so that a
64-image answer costs little more than a one-image answer; /attention answers its one image with
``prediction``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic_core import to_json

from service.contract.probabilities import softmax
from service.errors import InvalidInput
from service.frontend.hot_routes import add_model_routes
from service.frontend.inputs import read_images
from service.frontend.routers._openapi import ERROR_RESPONSES, multipart_schema, request_body
from service.frontend.schemas import (
    EXAMPLE_PNG_B64,
    Prediction,
    PredictOptions,
    PredictRequest,
    PredictResponse,
)
from service.frontend.serving import ServedVersion

# The routes check the API key (service/frontend/hot_routes.py).
router = APIRouter(tags=["inference"])

_MULTIPART = multipart_schema(
    "files",
    {
        "type": "array",
        "items": {"type": "string", "format": "binary"},
        "description": "One or more image files (PNG, JPEG, WebP, BMP, GIF), each a part named 'files'.",
    },
)
_EXAMPLES = {
    "b64": {"summary": "A base64 PNG", "value": {"images": [{"b64": EXAMPLE_PNG_B64}], "top_k": 3}},
    "pixels": {
        "summary": "Raw pixels, H x W",
        "value": {"images": [{"pixels": [[0, 255], [255, 0]]}]},
    },
}


def check_top_k(top_k: int, labels: list[str], given: bool = True) -> int:
    """The top_k to answer: the default is capped at the model's classes; one asked for beyond
    them is a 422."""
    if not given:
        return min(top_k, len(labels))
    if top_k > len(labels):
        raise InvalidInput(
            f"top_k: {top_k} is more than the model's {len(labels)} classes; the limit is {len(labels)}",
            field="top_k",
        )
    return top_k


def predictions(logits: np.ndarray, labels: list[str], top_k: int) -> list[dict[str, Any]]:
    """Logits ``[n, classes]`` -> one prediction per row (ties go to the lower class index)."""
    probabilities = softmax(np.atleast_2d(logits))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k].tolist()
    answers = []
    # the scores picked from Python lists: numpy's take_along_axis cost more than the rest together
    for row, indices in zip(probabilities.tolist(), order, strict=True):
        best = [{"label": labels[i], "index": i, "score": row[i]} for i in indices]
        answers.append({**best[0], "top_k": best})
    return answers


def prediction(logits: np.ndarray, labels: list[str], top_k: int) -> Prediction:
    """One image's logits -> its prediction, as the schema object."""
    return Prediction.model_validate(predictions(logits, labels, top_k)[0])


async def predict(request: Request, served: ServedVersion) -> Response:
    limit = served.settings.limits.max_images_per_request
    images, options = await read_images(request, PredictRequest, PredictOptions, "files", limit)
    if not images:  # a multipart body without file parts (JSON needs one image at least)
        raise InvalidInput(
            "files: no file part; send one or more parts named 'files'", field="files"
        )
    if len(images) > limit:
        raise InvalidInput(
            f"files: {len(images)} files; the limit is max_images_per_request={limit}",
            field="files",
            code="too_many_images",
        )
    labels = served.metadata.labels
    top_k = check_top_k(options.top_k, labels, given="top_k" in options.model_fields_set)
    logits = await served.classify(images, options.invert)
    # built as JSON directly: the dicts have PredictResponse's shape (tests check it against the
    # schema), without a second validation of every number by the response model
    body = {
        "model": {"name": served.name, "version": served.version},
        "predictions": predictions(logits, labels, top_k),
    }
    return Response(to_json(body), media_type="application/json")


add_model_routes(
    router,
    "/predict",
    predict,
    summary="Classify images",
    hot_lane=True,
    response_model=PredictResponse,
    description=(
        'JSON `{"images": [{"b64": ...} or {"pixels": ...}], "top_k": 5, "invert": "auto"}` or '
        "multipart/form-data with file parts named `files` and optional fields `top_k`, `invert`. "
        "One prediction per image, in order."
    ),
    responses=ERROR_RESPONSES,
    openapi_extra=request_body(
        "PredictRequest", _MULTIPART, _EXAMPLES, {"files": ["shoe.png"], "top_k": 3}
    ),
)
