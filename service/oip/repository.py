"""Triton's model repository extension: the index of every model version with its state, and explicit
load and unload (``VITSERVE_MODEL_CONTROL=explicit``; in the other modes they answer 400, as Triton does).

- ``POST /v2/repository/index``: ``[{"name", "version", "state", "reason"}]``; ``{"ready": true}`` lists
  only the versions that are ready.
- ``POST /v2/repository/models/{name}/load`` and ``/unload``: 200 with an empty body once done; a load that
  fails answers 400 with the reason, and what was served keeps serving.
"""

from __future__ import annotations

from fastapi import APIRouter, Body, Request, Response

from service.errors import ServiceError
from service.model_repository import ModelLoadError
from service.oip.routes import PROTECTED, RESPONSES
from service.oip.schemas import RepositoryIndexRequest, RepositoryModel
from service.state import service_state

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
    only_ready = options is not None and options.ready
    return [
        RepositoryModel(
            name=name, version="" if version is None else str(version), state=state, reason=reason
        )
        for name, version, state, reason in service_state(request).manager.index()
        if not only_ready or state == "READY"
    ]


def _explicit_only(request: Request, action: str) -> None:
    mode = service_state(request).settings.model_control
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
async def load(name: str, request: Request) -> Response:
    _explicit_only(request, "load")
    try:
        await service_state(request).manager.load(name)
    except ModelLoadError as error:
        raise ServiceError(
            f"failed to load '{name}': {error}", status_code=400, code="load_failed"
        ) from None
    return Response(status_code=200)


@router.post(
    "/models/{name}/unload",
    summary="Stop serving a model; its versions are released once their requests are answered",
    response_class=Response,
    responses=RESPONSES,
)
async def unload(name: str, request: Request) -> Response:
    _explicit_only(request, "unload")
    await service_state(request).manager.unload(name)
    return Response(status_code=200)
