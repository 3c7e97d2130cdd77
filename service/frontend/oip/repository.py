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

from service.contract.model_repository import ModelLoadError
from service.engine.state import ServiceState, service_state
from service.errors import ServiceError
from service.frontend.oip.routes import PROTECTED, RESPONSES
from service.frontend.oip.schemas import (
    RepositoryIndexRequest,
    RepositoryLoadRequest,
    RepositoryModel,
)

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
    return index_of(service_state(request), options is not None and options.ready)


def index_of(state: ServiceState, only_ready: bool) -> list[RepositoryModel]:
    """The repository index (every transport)."""
    return [
        RepositoryModel(
            name=name, version="" if version is None else str(version), state=status, reason=reason
        )
        for name, version, status, reason in state.manager.index()
        if not only_ready or status == "READY"
    ]


async def load_model(state: ServiceState, name: str) -> None:
    """Explicit load (every transport): 400 with the reason when it fails or is not allowed."""
    _explicit_only(state, "load")
    try:
        await state.manager.load(name)
    except ModelLoadError as error:
        raise ServiceError(
            f"failed to load '{name}': {error}", status_code=400, code="load_failed"
        ) from None


async def unload_model(state: ServiceState, name: str) -> None:
    """Explicit unload (every transport)."""
    _explicit_only(state, "unload")
    await state.manager.unload(name)


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


def _explicit_only(state: ServiceState, action: str) -> None:
    mode = state.settings.model_control
    if mode != "explicit":
        raise ServiceError(
            f"explicit model {action} is not allowed: the model control mode is '{mode}' "
            "(set VITSERVE_MODEL_CONTROL=explicit)",
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
    await load_model(service_state(request), name)
    return Response(status_code=200)


@router.post(
    "/models/{name}/unload",
    summary="Stop serving a model; its versions are released once their requests are answered",
    response_class=Response,
    responses=RESPONSES,
)
async def unload(name: str, request: Request) -> Response:
    await unload_model(service_state(request), name)
    return Response(status_code=200)
