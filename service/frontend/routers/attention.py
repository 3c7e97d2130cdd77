"""POST /attention: what the model looked at, as numbers (JSON) or as a heatmap overlay (PNG)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from service.contract.attention_maps import attention_map, overlay_png
from service.errors import InvalidInput
from service.frontend.hot_routes import add_model_routes
from service.frontend.inputs import read_images
from service.frontend.routers._openapi import ERROR_RESPONSES, multipart_schema, request_body
from service.frontend.routers.predict import check_top_k, prediction
from service.frontend.schemas import (
    EXAMPLE_PNG_B64,
    AttentionOptions,
    AttentionRequest,
    AttentionResponse,
    ModelRef,
)
from service.frontend.serving import ServedVersion

# The routes check the API key (service/frontend/hot_routes.py).
router = APIRouter(tags=["inference"])

_MULTIPART = multipart_schema(
    "file",
    {"type": "string", "format": "binary", "description": "One image file."},
    method={"type": "string", "enum": ["rollout", "raw"], "default": "rollout"},
    layer={"type": "integer", "minimum": 0},
    head={"type": "integer", "minimum": 0},
    format={"type": "string", "enum": ["json", "png"], "default": "json"},
)
_EXAMPLES = {
    "rollout": {"summary": "Rollout as JSON", "value": {"image": {"b64": EXAMPLE_PNG_B64}}},
    "raw": {
        "summary": "One head of the first layer",
        "value": {"image": {"b64": EXAMPLE_PNG_B64}, "method": "raw", "layer": 0, "head": 0},
    },
    "png": {
        "summary": "Heatmap overlay",
        "value": {"image": {"b64": EXAMPLE_PNG_B64}, "format": "png"},
    },
}


async def attention(request: Request, served: ServedVersion) -> Response | AttentionResponse:
    served.require_attention()
    images, options = await read_images(request, AttentionRequest, AttentionOptions, "file", 1)
    if len(images) != 1:  # a multipart body's file parts (JSON holds one image)
        raise InvalidInput(
            f"file: send exactly one file part named 'file' (got {len(images)})", field="file"
        )
    image = images[0]
    meta = served.metadata
    layer = meta.depth - 1 if options.layer is None else options.layer
    if layer >= meta.depth:
        raise InvalidInput(
            f"layer: {layer} is out of range; the model has {meta.depth} layers (0 to {meta.depth - 1})",
            field="layer",
        )
    if options.head is not None:
        if options.method != "raw":
            raise InvalidInput(
                "head: only used with method 'raw' (rollout fuses the heads by their mean)",
                field="head",
            )
        if options.head >= meta.heads:
            raise InvalidInput(
                f"head: {options.head} is out of range; the model has {meta.heads} heads "
                f"(0 to {meta.heads - 1})",
                field="head",
            )
    top_k = check_top_k(options.top_k, meta.labels, given="top_k" in options.model_fields_set)
    prepared, logits, maps = await served.attend(image, options.invert)
    best = prediction(logits, meta.labels, top_k)
    grid = meta.grid
    heatmap = await run_in_threadpool(
        attention_map,
        maps,
        method=options.method,
        layer=layer,
        head=options.head,
        pooling=meta.pooling,
        grid=grid,
    )
    if options.format == "png":
        png = await run_in_threadpool(overlay_png, prepared.display, heatmap)
        return Response(
            content=png,
            media_type="image/png",
            headers={
                "X-Prediction-Label": quote(best.label, safe=" /-_.()"),
                "X-Prediction-Index": str(best.index),
                "X-Prediction-Score": f"{best.score:.6f}",
            },
        )
    return AttentionResponse(
        model=ModelRef(name=served.name, version=served.version),
        prediction=best,
        method=options.method,
        layer=layer,
        head=options.head,
        pooling=meta.pooling,
        grid=grid,
        inverted=prepared.inverted,
        map=heatmap.tolist(),
    )


add_model_routes(
    router,
    "/attention",
    attention,
    summary="Attention map of one image",
    response_model=AttentionResponse,
    description=(
        'JSON `{"image": {"b64": ...} or {"pixels": ...}, "method": "rollout", "layer": null, '
        '"head": null, "format": "json"}` or multipart/form-data with a file part `file` and the same '
        "options as fields. `format=png` answers `image/png`: the model's view of the image (upscaled to "
        "at least 224 px a side) with the map overlaid in the inferno colormap; the prediction is in the "
        "headers `X-Prediction-Label`, `X-Prediction-Index` and `X-Prediction-Score`. Only for models "
        "with an attention graph (404 otherwise)."
    ),
    responses={
        **ERROR_RESPONSES,
        200: {
            "content": {"image/png": {}},
            "description": "The map as JSON, or the overlay as PNG.",
        },
    },
    openapi_extra=request_body(
        "AttentionRequest", _MULTIPART, _EXAMPLES, {"file": "shoe.png", "format": "png"}
    ),
)
