"""Liveness and readiness (open, no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.frontend.schemas import Health

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live", response_model=Health, summary="The process is up")
async def live() -> Health:
    return Health(status="live", ready=True)


@router.get(
    "/ready",
    response_model=Health,
    summary="The default model is loaded, warmed up and running, and the service is not shutting down",
    responses={
        503: {
            "model": Health,
            "description": "Starting, shutting down, or the default model unavailable.",
        }
    },
)
async def ready(request: Request) -> JSONResponse:
    state = request.app.state.frontend
    if state.ready:
        return JSONResponse(Health(status="ready", ready=True).model_dump())
    phase = state.phase
    status = {"starting": "starting", "ready": "unavailable"}.get(phase, "shutting_down")
    return JSONResponse(Health(status=status, ready=False).model_dump(), status_code=503)
