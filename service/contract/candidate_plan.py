"""A candidate version of a model, tried on live traffic before it takes it: the ``vitserve_``
parameters of its ``config.pbtxt`` read as a :class:`CandidatePlan` (:func:`candidate_plan`), and
written back (:func:`with_candidate_plan`: promotion and rollback; :func:`with_trial`: the export
starting a candidate's trial).

The file itself, its serving settings and version policies are ``service/contract/model_config.py``'s;
which version answers while a candidate is tried is ``service/contract/candidates.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from service.contract.model_config import (
    ModelConfig,
    ModelConfigError,
    select_versions,
    version_policy,
)

# vitserve's own parameters in a config.pbtxt (Triton keeps a model's ``parameters`` for its backend
# and ignores those it does not know). ``vitserve_live_version`` pins the version unversioned requests
# get (promotion writes it).
LIVE_VERSION = "vitserve_live_version"
CANDIDATE_VERSION = "vitserve_candidate_version"
SHADOW_PERCENT = "vitserve_shadow_percent"
CANARY_PERCENT = "vitserve_canary_percent"
SHADOW_QUEUE_SIZE = "vitserve_shadow_queue_size"
SHADOW_TIMEOUT_MS = "vitserve_shadow_timeout_ms"
# automatic promotion in poll mode: all three thresholds, or none
PROMOTE_MIN_REQUESTS = "vitserve_promote_min_requests"
PROMOTE_MIN_AGREEMENT = "vitserve_promote_min_agreement"
PROMOTE_MAX_LATENCY_RATIO = "vitserve_promote_max_latency_ratio"
PROMOTE_MAX_P99_DIFFERENCE = "vitserve_promote_max_p99_difference"
DEFAULT_SHADOW_QUEUE_SIZE = 64
DEFAULT_SHADOW_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class CandidatePlan:
    """What a model's parameters say of its versions on live traffic.

    ``live_version``: the version unversioned requests get (None: the newest ready one other than the
    candidate). ``candidate_version``: the version tried (None: none). ``shadow_percent`` of the live
    version's requests are also run on the candidate and compared, never answered from it;
    ``canary_percent`` of unversioned requests are answered by it. At most ``shadow_queue_size``
    shadow requests wait (more are shed) and each may run ``shadow_timeout_s``.
    """

    live_version: int | None = None
    candidate_version: int | None = None
    shadow_percent: float = 0.0
    canary_percent: float = 0.0
    shadow_queue_size: int = DEFAULT_SHADOW_QUEUE_SIZE
    shadow_timeout_s: float = DEFAULT_SHADOW_TIMEOUT_MS / 1000
    # automatic promotion (poll mode): the thresholds of ``python -m service.promote``, or None
    promote_min_requests: int | None = None
    promote_min_agreement: float | None = None
    promote_max_latency_ratio: float | None = None
    promote_max_p99_difference: float | None = None

    @property
    def promoting(self) -> bool:
        return self.candidate_version is not None and self.promote_min_requests is not None

    @property
    def shadowing(self) -> bool:
        return self.candidate_version is not None and self.shadow_percent > 0


def _parameter_number(config: ModelConfig, key: str, kind: type) -> int | float | None:
    if key not in config.parameters:
        return None
    text = config.parameters[key].string_value.strip()
    try:
        return kind(text)
    except ValueError:
        raise ModelConfigError(
            f"parameter {key} must be {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def candidate_plan(config: ModelConfig) -> CandidatePlan:
    """The model's :class:`CandidatePlan`; :class:`ModelConfigError` naming a parameter out of range,
    a ``vitserve_`` parameter this service does not know (a typo must not pass silently), or a share
    without a candidate."""
    known = {
        LIVE_VERSION,
        CANDIDATE_VERSION,
        SHADOW_PERCENT,
        CANARY_PERCENT,
        SHADOW_QUEUE_SIZE,
        SHADOW_TIMEOUT_MS,
        PROMOTE_MIN_REQUESTS,
        PROMOTE_MIN_AGREEMENT,
        PROMOTE_MAX_LATENCY_RATIO,
        PROMOTE_MAX_P99_DIFFERENCE,
    }
    unknown = sorted(k for k in config.parameters if k.startswith("vitserve_") and k not in known)
    if unknown:
        raise ModelConfigError(f"unknown parameters {unknown}; known: {sorted(known)}")
    live = _parameter_number(config, LIVE_VERSION, int)
    candidate = _parameter_number(config, CANDIDATE_VERSION, int)
    shadow = _parameter_number(config, SHADOW_PERCENT, float)
    canary = _parameter_number(config, CANARY_PERCENT, float)
    queue = _parameter_number(config, SHADOW_QUEUE_SIZE, int)
    timeout_ms = _parameter_number(config, SHADOW_TIMEOUT_MS, float)
    min_requests = _parameter_number(config, PROMOTE_MIN_REQUESTS, int)
    min_agreement = _parameter_number(config, PROMOTE_MIN_AGREEMENT, float)
    max_ratio = _parameter_number(config, PROMOTE_MAX_LATENCY_RATIO, float)
    max_p99 = _parameter_number(config, PROMOTE_MAX_P99_DIFFERENCE, float)
    problems = []
    required = (PROMOTE_MIN_REQUESTS, PROMOTE_MIN_AGREEMENT, PROMOTE_MAX_LATENCY_RATIO)
    given = [v is not None for v in (min_requests, min_agreement, max_ratio)]
    if (any(given) or max_p99 is not None) and not all(given):
        problems.append(f"automatic promotion needs all of {', '.join(required)}")
    if min_requests is not None and min_requests < 1:
        problems.append(f"{PROMOTE_MIN_REQUESTS} must be 1 or more, got {min_requests}")
    if min_agreement is not None and not 0 <= min_agreement <= 1:
        problems.append(f"{PROMOTE_MIN_AGREEMENT} must lie in 0..1, got {min_agreement:g}")
    for key, most in (
        (PROMOTE_MAX_LATENCY_RATIO, max_ratio),
        (PROMOTE_MAX_P99_DIFFERENCE, max_p99),
    ):
        if most is not None and not most > 0:
            problems.append(f"{key} must be above 0, got {most:g}")
    if all(given) and candidate is None:
        problems.append(f"automatic promotion needs {CANDIDATE_VERSION}")
    for key, version in ((LIVE_VERSION, live), (CANDIDATE_VERSION, candidate)):
        if version is not None and version < 1:
            problems.append(f"{key} must be a version number (1 or more), got {version}")
    if live is not None and live == candidate:
        problems.append(f"{CANDIDATE_VERSION} must differ from {LIVE_VERSION} ({live})")
    for key, share in ((SHADOW_PERCENT, shadow), (CANARY_PERCENT, canary)):
        if share is not None and not 0 <= share <= 100:
            problems.append(f"{key} must lie in 0..100, got {share:g}")
        if share and candidate is None:
            problems.append(f"{key} needs {CANDIDATE_VERSION}")
    if queue is not None and queue < 1:
        problems.append(f"{SHADOW_QUEUE_SIZE} must be 1 or more, got {queue}")
    if timeout_ms is not None and not timeout_ms > 0:
        problems.append(f"{SHADOW_TIMEOUT_MS} must be above 0, got {timeout_ms:g}")
    if problems:
        raise ModelConfigError("; ".join(problems))
    return CandidatePlan(
        live_version=live,  # type: ignore[arg-type]
        candidate_version=candidate,  # type: ignore[arg-type]
        shadow_percent=shadow or 0.0,
        canary_percent=canary or 0.0,
        shadow_queue_size=queue or DEFAULT_SHADOW_QUEUE_SIZE,  # type: ignore[arg-type]
        shadow_timeout_s=(timeout_ms or DEFAULT_SHADOW_TIMEOUT_MS) / 1000,
        promote_min_requests=min_requests,  # type: ignore[arg-type]
        promote_min_agreement=min_agreement,
        promote_max_latency_ratio=max_ratio,
        promote_max_p99_difference=max_p99,
    )


def with_candidate_plan(config: ModelConfig, plan: CandidatePlan) -> ModelConfig:
    """A copy of ``config`` whose vitserve parameters say ``plan`` (promotion and rollback write it)."""
    copy = ModelConfig()
    copy.CopyFrom(config)
    values = {
        LIVE_VERSION: plan.live_version,
        CANDIDATE_VERSION: plan.candidate_version,
        SHADOW_PERCENT: plan.shadow_percent or None,
        CANARY_PERCENT: plan.canary_percent or None,
        PROMOTE_MIN_REQUESTS: plan.promote_min_requests,
        PROMOTE_MIN_AGREEMENT: plan.promote_min_agreement,
        PROMOTE_MAX_LATENCY_RATIO: plan.promote_max_latency_ratio,
        PROMOTE_MAX_P99_DIFFERENCE: plan.promote_max_p99_difference,
    }
    for key, value in values.items():
        if value is None:
            if key in copy.parameters:
                del copy.parameters[key]
        else:
            copy.parameters[key].string_value = (
                f"{value:g}" if isinstance(value, float) else str(value)
            )
    return copy


def with_trial(config: ModelConfig, available: Sequence[int], candidate: int) -> ModelConfig:
    """A copy of ``config`` that starts ``candidate``'s trial on live traffic: the version served
    now (among ``available``, the model's other versions) pinned live, the version policy keeping
    both loaded, and the candidate shadowing every live request, answering none (no canary). Written
    before the candidate's directory appears, so that the new version never answers before its
    trial starts. :class:`ModelConfigError` when another trial is under way or nothing is served."""
    plan = candidate_plan(config)
    if plan.candidate_version not in (None, candidate):
        raise ModelConfigError(
            f"model {config.name!r} is already trying version {plan.candidate_version} "
            f"({CANDIDATE_VERSION}); promote it or roll it back first "
            "(python -m service.promote, or POST /models/NAME/shadow/promote|rollback)"
        )
    policy = version_policy(config)
    served = select_versions(policy, [v for v in available if v != candidate])
    live = plan.live_version if plan.live_version in served else (max(served) if served else None)
    if live is None:
        raise ModelConfigError(
            f"model {config.name!r} serves no version to try version {candidate} against; export "
            "it without --candidate"
        )
    # every other field of the plan (the shadow's queue, the promotion thresholds) as it was
    trial = replace(
        plan,
        live_version=live,
        candidate_version=candidate,
        shadow_percent=plan.shadow_percent or 100.0,
    )
    copy = with_candidate_plan(config, trial)
    if policy[0] != "all":
        copy.version_policy.specific.versions[:] = sorted({*served, candidate})
    return copy
