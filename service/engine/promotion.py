"""Promotion and rollback of a model's candidate version, written into its config.pbtxt.

Promotion pins the candidate as the live version (``vitserve_live_version``) and ends its trial (the
candidate, shadow and canary parameters are removed); rollback ends the trial and pins the live version
it had. Either is written into the model's ``config.pbtxt`` atomically, then the model is loaded again
from it, as an explicit load would: the decision is the repository's, so it survives a restart, and
editing the file by hand then loading it (``/v2/repository/models/{name}/load``, or the next poll) does
the same. The versions the policy keeps stay loaded, so a promotion can be undone the same way. Which
thresholds justify a promotion is the caller's to decide (``python -m service.promote``), or, in poll
mode, the model's own parameters' (:func:`watch`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from service.contract.candidate_plan import CandidatePlan, with_candidate_plan
from service.contract.candidates import Thresholds, judge
from service.contract.model_config import write_model_config
from service.contract.model_repository import CONFIG_FILE, ModelLoadError
from service.engine.model_manager import ModelManager
from service.engine.model_versions import model_config
from service.engine.shadow import Shadows
from service.errors import ServiceError

logger = logging.getLogger("vitserve")


def _conflict(message: str) -> ServiceError:
    return ServiceError(message, status_code=409, code="no_candidate")


async def decide(manager: ModelManager, op: str, name: str, version: int | None) -> dict[str, Any]:
    """``promote`` (the candidate, which must be ``version`` when given, becomes live) or
    ``rollback`` (the candidate's trial ends); what the model serves afterwards."""
    model = manager.model(name)
    plan = model.plan
    candidate = plan.candidate_version
    if candidate is None:
        raise _conflict(
            f"model {model.name!r} has no candidate version (vitserve_candidate_version)"
        )
    if version is not None and version != candidate:
        raise _conflict(
            f"model {model.name!r}'s candidate is version {candidate}, not version {version}"
        )
    if op == "promote" and candidate not in model.ready_versions():
        raise _conflict(
            f"model {model.name!r}'s candidate version {candidate} is not ready; it cannot be promoted"
        )
    before = model.live_version()
    repository = manager.repository
    on_disk = model_config(repository, model.name)
    ended = replace(
        plan,
        candidate_version=None,
        shadow_percent=0.0,
        canary_percent=0.0,
        promote_min_requests=None,
        promote_min_agreement=None,
        promote_max_latency_ratio=None,
        promote_max_p99_difference=None,
    )
    # either way the live version is pinned: unpinned, the newest loaded version would be live, and
    # after a rollback that is often the candidate itself
    decided: CandidatePlan = replace(ended, live_version=candidate if op == "promote" else before)
    path = repository / model.name / CONFIG_FILE
    try:
        write_model_config(with_candidate_plan(on_disk, decided), path)
    except OSError as error:
        raise ServiceError(
            f"cannot write {model.name}/{CONFIG_FILE} ({error.strerror}); edit it to say "
            f"{'vitserve_live_version: ' + str(candidate) if op == 'promote' else 'no candidate'} "
            "and load the model",
            status_code=409,
            code="repository_read_only",
        ) from None
    try:
        await manager.load(model.name)
    except ModelLoadError as error:
        raise ServiceError(
            f"{op} of {model.name!r} written, but loading it failed: {error}",
            status_code=400,
            code="load_failed",
        ) from None
    after = manager.model(model.name).live_version()
    logger.warning(
        "%s %s: candidate version %s %s; live version %s -> %s",
        op,
        model.name,
        candidate,
        "promoted" if op == "promote" else "rolled back",
        before,
        after,
    )
    return {
        "model": model.name,
        "action": op,
        "candidate_version": candidate,
        "live_version_before": before,
        "live_version": after,
    }


async def watch(manager: ModelManager, shadows: Shadows, every_s: float) -> None:
    """Poll mode's automatic promotion: every ``every_s``, each model whose parameters give the
    thresholds (``vitserve_promote_*``) has its candidate judged as ``python -m service.promote``
    would, and promoted or rolled back once the evidence is in. Runs until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        for name, model in list(manager.models.items()):
            plan = model.plan
            if not plan.promoting:
                continue
            thresholds = Thresholds(
                plan.promote_min_agreement,  # type: ignore[arg-type]
                plan.promote_min_requests,  # type: ignore[arg-type]
                plan.promote_max_latency_ratio,  # type: ignore[arg-type]
                plan.promote_max_p99_difference,
            )
            verdict = judge(shadows.report(name), thresholds)
            if verdict.action == "wait":
                continue
            logger.warning(
                "%s: automatic %s%s",
                verdict.summary,
                verdict.action,
                f" ({'; '.join(verdict.reasons)})" if verdict.reasons else "",
            )
            try:
                await decide(manager, verdict.action, name, plan.candidate_version)
            except ServiceError as error:
                logger.error("automatic %s of %s failed: %s", verdict.action, name, error.message)
