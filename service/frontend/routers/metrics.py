"""GET /metrics in the Prometheus text format (open, no API key).

The engine writes Triton's ``nv_inference_*`` series when asked (service/engine/statistics.py), so a
scrape first asks it; an engine that cannot be reached leaves the numbers it last wrote."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.errors import ServiceError
from service.frontend.state import frontend_state
from service.observability.metrics import exposition

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}
    },
)
async def metrics(request: Request) -> Response:
    with contextlib.suppress(ServiceError):
        await frontend_state(request).engine.control("metrics")
    return Response(exposition(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
