"""Liveness and readiness (open, no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.schemas import Health

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live", response_model=Health, summary="The process is up")
async def live() -> Health:
    return Health(status="live", ready=True)


@router.get(
    "/ready",
    response_model=Health,
    summary="The model is loaded and warmed up, and the service is not shutting down",
    responses={503: {"model": Health, "description": "Starting or shutting down."}},
)
async def ready(request: Request) -> JSONResponse:
    phase = request.app.state.service.phase
    if phase == "ready":
        return JSONResponse(Health(status="ready", ready=True).model_dump())
    status = "starting" if phase == "starting" else "shutting_down"
    return JSONResponse(Health(status=status, ready=False).model_dump(), status_code=503)
