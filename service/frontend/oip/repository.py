"""Triton's model repository extension: the index of every model version with its state, and explicit
load and unload (``VITSERVE_MODEL_CONTROL=explicit``; in the other modes they answer 400, as Triton does).

- ``POST /v2/repository/index``: ``[{"name", "version", "state", "reason"}]``; ``{"ready": true}`` lists
  only the versions that are ready.
- ``POST /v2/repository/models/{name}/load`` and ``/unload``: 200 with an empty body once done; a load that
  fails answers 400 with the reason, and what was served keeps serving. Triton's load parameters (a
  config override, model files) are refused with 400: the repository's files are what is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Body, Request, Response

from service.errors import ServiceError
from service.frontend.oip.routes import PROTECTED, RESPONSES
from service.frontend.oip.schemas import (
    RepositoryIndexRequest,
    RepositoryLoadRequest,
    RepositoryModel,
)
from service.frontend.state import FrontendState, frontend_state

router = APIRouter(prefix="/v2/repository", tags=["model repository"], dependencies=PROTECTED)


@router.post(
    "/index",
    response_model=list[RepositoryModel],
    summary="Every model version in the repository, with its state",
    responses=RESPONSES,
)
async def repository_index(
    request: Request, options: RepositoryIndexRequest | None = Body(default=None)
) -> list[RepositoryModel]:
    return await index_of(frontend_state(request), options is not None and options.ready)


async def index_of(state: FrontendState, only_ready: bool) -> list[RepositoryModel]:
    """The repository index (every transport)."""
    return [
        RepositoryModel(
            name=name, version="" if version is None else str(version), state=status, reason=reason
        )
        for name, version, status, reason in await state.engine.control("index")
        if not only_ready or status == "READY"
    ]


async def load_model(state: FrontendState, name: str) -> None:
    """Explicit load (every transport): 400 with the reason when it fails or is not allowed."""
    await state.engine.control("load", name=name)


async def unload_model(state: FrontendState, name: str) -> None:
    """Explicit unload (every transport)."""
    await state.engine.control("unload", name=name)


def refuse_load_parameters(parameters: Mapping[str, Any] | None) -> None:
    """Triton's load parameters (a config override, files) are not offered: 400 naming them."""
    if parameters:
        raise ServiceError(
            f"load parameters are not supported (got {', '.join(sorted(parameters))}): vitserve "
            "loads a model's files and config.pbtxt from the repository as they are; change them "
            "there, then load",
            status_code=400,
            code="bad_request",
        )


@router.post(
    "/models/{name}/load",
    summary="Load (or reload) a model's versions as its version policy says",
    response_class=Response,
    responses=RESPONSES,
)
async def load(
    name: str, request: Request, options: RepositoryLoadRequest | None = Body(default=None)
) -> Response:
    refuse_load_parameters(options.parameters if options is not None else None)
    await load_model(frontend_state(request), name)
    return Response(status_code=200)


@router.post(
    "/models/{name}/unload",
    summary="Stop serving a model; its versions are released once their requests are answered",
    response_class=Response,
    responses=RESPONSES,
)
async def unload(name: str, request: Request) -> Response:
    await unload_model(frontend_state(request), name)
    return Response(status_code=200)
