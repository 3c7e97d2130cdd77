"""A model's candidate version on live traffic: its shadow comparison, and its promotion or rollback.

``GET /models/{name}/shadow`` answers the engine's comparison (service/engine/shadow.py) of the live
version and the candidate on the same live requests (each on its own rows when their preprocessing
differs); ``POST .../promote`` and ``.../rollback`` end the trial
(service/engine/promotion.py: written into the model's config.pbtxt, then loaded).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from service.contract.model_repository import MAX_VERSION
from service.frontend.routers._openapi import ERROR_RESPONSES
from service.frontend.security import require_api_key
from service.frontend.state import frontend_state

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key)])


class ProbabilityDifference(BaseModel):
    definition: str
    mean: float | None
    p99: float | None = Field(description="over the latest 100,000 images compared")


class ModelTimes(BaseModel):
    """Each version's model time on the same shadow batches, measured as pairs."""

    definition: str
    pairs: int = Field(description="the timed pairs the numbers rest on")
    live_p50: float | None
    live_p99: float | None
    candidate_p50: float | None
    candidate_p99: float | None
    ratio_p50: float | None = Field(description="the median of candidate / live over the pairs")


class Confusion(BaseModel):
    live_class: int
    candidate_class: int
    images: int


class PairComparison(BaseModel):
    live_version: int
    candidate_version: int
    requests_compared: int
    images_compared: int
    top1_agreement: float | None
    probability_difference: ProbabilityDifference
    model_ms: ModelTimes
    confusion: list[Confusion]
    outcomes: dict[str, int] = Field(
        description=(
            "what became of the shadow copies: compared, shed, failed, timeout, live_failed, "
            "incompatible"
        )
    )


class ShadowQueue(BaseModel):
    size: int
    waiting: int
    timeout_s: float


class ShadowReport(BaseModel):
    model: str
    live_version: int | None
    candidate_version: int | None
    candidate_ready: bool
    comparable: bool | None = Field(
        description="whether the candidate's answers can be compared with the live version's "
        "(None: no candidate ready)"
    )
    rows: str | None = Field(
        description="same: the candidate runs the live rows; own: the front end prepares its own "
        "rows from the same images (other preprocessing); none: not comparable"
    )
    why: str | None
    shadow_percent: float
    canary_percent: float
    shadow_queue: ShadowQueue
    pairs: list[PairComparison]


class Decision(BaseModel):
    model: str
    action: str
    candidate_version: int
    live_version_before: int | None
    live_version: int | None


@router.get(
    "/models/{name}/shadow",
    response_model=ShadowReport,
    operation_id="model_shadow",
    summary="The candidate version against the live one, on the same live requests",
    responses=ERROR_RESPONSES,
)
async def shadow(name: str, request: Request) -> ShadowReport:
    state = frontend_state(request)
    return ShadowReport.model_validate(await state.engine.shadow(name))


@router.post(
    "/models/{name}/shadow/promote",
    response_model=Decision,
    operation_id="model_promote",
    summary="Promote the candidate: it becomes the version unversioned requests get",
    responses=ERROR_RESPONSES,
)
async def promote(
    name: str,
    request: Request,
    version: int | None = Query(
        None, ge=1, le=MAX_VERSION, description="the candidate expected (409 if not)"
    ),
) -> Decision:
    state = frontend_state(request)
    return Decision.model_validate(await state.engine.promote(name, version))


@router.post(
    "/models/{name}/shadow/rollback",
    response_model=Decision,
    operation_id="model_rollback",
    summary="Roll the candidate back: no more shadow or canary; the live version stays",
    responses=ERROR_RESPONSES,
)
async def rollback(name: str, request: Request) -> Decision:
    state = frontend_state(request)
    return Decision.model_validate(await state.engine.rollback(name))
