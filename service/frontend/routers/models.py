"""GET /models and /models/{name}: every model, its versions and their states, and how each is served."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from service.contract.decoding import ACCEPTED_FORMATS
from service.contract.table import ModelTable, ModelView
from service.frontend.routers._openapi import ERROR_RESPONSES
from service.frontend.schemas import (
    BatchingInfo,
    InputInfo,
    LimitsInfo,
    ModelInfo,
    ModelsResponse,
    VersionInfo,
)
from service.frontend.security import require_api_key
from service.frontend.state import frontend_state
from service.settings import LimitSettings, Settings

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key)])


def _limits(limits: LimitSettings) -> LimitsInfo:
    return LimitsInfo(
        max_body_bytes=limits.max_body_bytes,
        max_images_per_request=limits.max_images_per_request,
        max_pixels_per_image=limits.max_pixels_per_image,
        max_pixels_per_request=limits.max_pixels_per_request,
        accepted_formats=list(ACCEPTED_FORMATS),
    )


def model_info(settings: Settings, table: ModelTable, model: ModelView) -> ModelInfo:
    versions = [
        VersionInfo(version=v, state=state, reason=reason)
        for v, (state, reason) in sorted(model.versions.items())
    ]
    common = {
        "name": model.name,
        "default": model.name == table.default_name,
        "versions": versions,
        "limits": _limits(settings.limits),
    }
    view = model.view()
    if view is None:
        return ModelInfo(version=None, **common)
    meta, serving = view.metadata, view.serving
    return ModelInfo(
        version=view.version,
        labels=meta.labels,
        input=InputInfo(**meta.input.model_dump()),
        preprocessing=meta.preprocessing.model_dump(),
        attention=view.attention,
        grid=meta.grid if meta.patch is not None else None,
        pooling=meta.pooling,
        depth=meta.depth,
        heads=meta.heads,
        precision=meta.precision,
        dataset=meta.dataset,
        test_accuracy=meta.test_accuracy,
        provider=view.provider,
        batching=BatchingInfo(
            max_batch_size=serving.max_batch_size,
            preferred_batch_sizes=list(serving.preferred_batch_sizes),
            attention_max_batch_size=settings.batching.attention_max_batch_size,
            max_queue_delay_ms=serving.max_queue_delay_s * 1000.0,
            max_queue_size=serving.max_queue_size,
            request_timeout_s=serving.request_timeout_s,
            instance_count=serving.instance_count,
        ),
        **common,
    )


@router.get(
    "/models", response_model=ModelsResponse, summary="The models served", responses=ERROR_RESPONSES
)
async def models(request: Request) -> ModelsResponse:
    state = frontend_state(request)
    table = state.engine.table
    return ModelsResponse(
        models=[
            model_info(state.settings, table, model) for _, model in sorted(table.models.items())
        ]
    )


@router.get(
    "/models/{name}",
    response_model=ModelInfo,
    summary="One model: its versions and how it is served",
    responses=ERROR_RESPONSES,
)
async def model(name: str, request: Request) -> ModelInfo:
    state = frontend_state(request)
    table = state.engine.table
    return model_info(state.settings, table, table.model(name))
