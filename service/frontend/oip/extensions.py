"""Triton's model configuration and statistics extensions over HTTP (gRPC: grpc_service.py); the engine
builds both answers (service/engine/reports.py says what they hold).

- ``GET /v2/models/{name}[/versions/{version}]/config``: the model's ``ModelConfig`` as JSON, as Triton
  answers it.
- ``GET /v2/models/stats``, ``/v2/models/{name}/stats``, ``/v2/models/{name}/versions/{version}/stats``:
  ``{"model_stats": [...]}``, one entry per ready version.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.frontend.oip.routes import PROTECTED, RESPONSES, version_number
from service.frontend.state import frontend_state

router = APIRouter(prefix="/v2", tags=["open inference protocol"], dependencies=PROTECTED)


@router.get("/models/stats", summary="Statistics of every ready model version", responses=RESPONSES)
async def all_statistics(request: Request) -> dict[str, Any]:
    engine = frontend_state(request).engine
    return {"model_stats": await engine.control("statistics")}


async def model_statistics(
    request: Request, name: str, version: str | None = None
) -> dict[str, Any]:
    engine = frontend_state(request).engine
    stats = await engine.control("statistics", name=name, version=version_number(version))
    return {"model_stats": stats}


async def model_config(request: Request, name: str, version: str | None = None) -> dict[str, Any]:
    engine = frontend_state(request).engine
    return await engine.control("config", name=name, version=version_number(version))


for suffix, endpoint, summary in (
    ("/stats", model_statistics, "Statistics of a model's ready versions (Triton's extension)"),
    ("/config", model_config, "The model's configuration (Triton's ModelConfig as JSON)"),
):
    router.get(f"/models/{{name}}{suffix}", summary=summary, responses=RESPONSES)(endpoint)
    router.get(
        f"/models/{{name}}/versions/{{version}}{suffix}", summary=summary, responses=RESPONSES
    )(endpoint)
