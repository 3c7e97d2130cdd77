"""GET /metrics in the Prometheus text format (open, no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

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
    return Response(exposition(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
