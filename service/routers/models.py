"""GET /models and /models/{name}: what is served, with which provider and settings."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from service.errors import NotFound
from service.preprocessing import ACCEPTED_FORMATS
from service.routers._openapi import ERROR_RESPONSES
from service.schemas import (
    BatchingInfo,
    ErrorResponse,
    InputInfo,
    LimitsInfo,
    ModelInfo,
    ModelsResponse,
)
from service.security import require_api_key
from service.state import ServiceState

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key)])


def model_info(state: ServiceState) -> ModelInfo:
    runtime = state.serving().runtime
    settings, meta, entry = state.settings, runtime.metadata, runtime.entry
    return ModelInfo(
        name=entry.name,
        version=entry.version,
        labels=meta.labels,
        input=InputInfo(**meta.input.model_dump()),
        preprocessing=meta.preprocessing.model_dump(),
        grid=meta.grid,
        pooling=meta.pooling,
        depth=meta.depth,
        heads=meta.heads,
        dataset=meta.dataset,
        test_accuracy=meta.test_accuracy,
        provider=runtime.provider,
        batching=BatchingInfo(
            max_batch_size=settings.max_batch_size,
            attention_max_batch_size=settings.attention_max_batch_size,
            max_queue_delay_ms=settings.max_queue_delay_ms,
            max_queue_size=settings.max_queue_size,
            request_timeout_s=settings.request_timeout_s,
        ),
        limits=LimitsInfo(
            max_body_bytes=settings.max_body_bytes,
            max_images_per_request=settings.max_images_per_request,
            max_pixels_per_image=settings.max_pixels_per_image,
            accepted_formats=list(ACCEPTED_FORMATS),
        ),
    )


@router.get(
    "/models", response_model=ModelsResponse, summary="The models served", responses=ERROR_RESPONSES
)
async def models(request: Request) -> ModelsResponse:
    return ModelsResponse(models=[model_info(request.app.state.service)])


@router.get(
    "/models/{name}",
    response_model=ModelInfo,
    summary="One model served",
    responses={
        **ERROR_RESPONSES,
        404: {"model": ErrorResponse, "description": "No model of that name is served."},
    },
)
async def model(name: str, request: Request) -> ModelInfo:
    info = model_info(request.app.state.service)
    if name != info.name:
        raise NotFound(
            f"name: no model {name!r} is served; this service serves {info.name!r}", field="name"
        )
    return info
