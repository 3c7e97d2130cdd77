"""Each model's serving settings: its ``config.pbtxt``, read and written as Triton's ``ModelConfig``.

The protobuf is Triton's own (``inference.ModelConfig``, generated code shipped in tritonclient), parsed
and printed with ``google.protobuf.text_format``: a file Triton would refuse (an unknown field, a wrong
enum) is refused here too, and a file written here is one Triton reads. :func:`serving_config` turns it
into the few settings the service uses; environment variables override them (``overrides``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from service.contract.limits import LIMITS

ModelConfig = model_config_pb2.ModelConfig
DataType = model_config_pb2.DataType
CONFIG_FILE = "config.pbtxt"
# Triton's platform name for the models this service serves (config.pbtxt, metadata, /v2).
PLATFORM = "onnxruntime_onnx"

# ("latest", n) | ("specific", (v, ...)) | ("all",): Triton's three version policies.
VersionPolicy = tuple[str, int] | tuple[str, tuple[int, ...]] | tuple[str]


# The serving defaults: what the export writes into a new config.pbtxt, and what a model without one
# gets (the queue's bounds also stand in for a config's missing ones). Two instances, as Triton's ONNX
# Runtime backend starts on the CPU: a batch runs while the next one fills, and the model's threads use
# the cores the front ends leave idle. Batches of 16, not 32: with two instances that kept p99 below a
# single instance's of 32 (docs/decisions.md#default-batching).
DEFAULT_MAX_BATCH_SIZE = 16
DEFAULT_INSTANCE_COUNT = 2
DEFAULT_QUEUE_DELAY_US = 2000
DEFAULT_MAX_QUEUE_SIZE = 512
DEFAULT_REQUEST_TIMEOUT_US = 30_000_000

# The encoded-image input: one image file (PNG, JPEG, WebP, BMP or GIF) per batch element, which the
# service decodes and preprocesses as /predict does; a request sends either it or the graph's tensor.
# It is declared nowhere a generic client reads: not in config.pbtxt (the file's inputs are the ONNX
# graph's, and Triton's ONNX Runtime backend refuses one the graph lacks), nor in the served model
# metadata or configuration, whose every input generic Triton clients fill (perf_analyzer 2.51 sends
# data for every input of the metadata, optional or not, and refuses a configured input the metadata
# lacks): docs/decisions.md#encoded-image-input-undeclared.
ENCODED_IMAGE_INPUT = "image"

MAX_CONFIG_BYTES = 1024 * 1024  # a config.pbtxt is a few hundred bytes; a larger one is refused


class ModelConfigError(ValueError):
    """A config.pbtxt that cannot be parsed, or whose settings the service cannot run."""


def parse_model_config(text: str, source: str | Path = CONFIG_FILE) -> ModelConfig:
    """``text`` in protobuf text format -> ModelConfig; the error names ``source`` and the line."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as error:
        line, column = error.GetLine(), error.GetColumn()
        message = str(error).split(" : ", 1)[-1] if line else str(error)
        where = f"line {line}, column {column}" if line else "parse error"
        raise ModelConfigError(f"{source}: {where}: {message}") from error


def read_model_config(path: str | Path, source: str | Path | None = None) -> ModelConfig:
    """The file at ``path``; errors name it as ``source`` (default: the path)."""
    path = Path(path)
    source = path if source is None else source
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ModelConfigError(
                f"{source}: larger than the limit of {MAX_CONFIG_BYTES} bytes for a config.pbtxt"
            )
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else error
        raise ModelConfigError(f"{source}: cannot read it ({reason})") from error
    return parse_model_config(text, source)


def format_model_config(config: ModelConfig) -> str:
    return text_format.MessageToString(config, use_short_repeated_primitives=True)


def write_model_config(config: ModelConfig, path: str | Path) -> None:
    """Write atomically: a reader sees the old file or the new one, never a part of either."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(format_model_config(config))
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def default_model_config(
    name: str,
    input_name: str,
    dims: Sequence[int],
    num_classes: int,
    *,
    output_name: str = "logits",
    label_filename: str = "labels.txt",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
    request_timeout_us: int = DEFAULT_REQUEST_TIMEOUT_US,
    instance_count: int = DEFAULT_INSTANCE_COUNT,
) -> ModelConfig:
    """An ONNX Runtime image classifier: float32 ``[batch, *dims]`` in, ``[batch, classes]`` out,
    with the service's default batching and queue settings."""
    config = ModelConfig(
        name=name,
        platform="onnxruntime_onnx",
        max_batch_size=max_batch_size,
        version_policy=model_config_pb2.ModelVersionPolicy(
            latest=model_config_pb2.ModelVersionPolicy.Latest(num_versions=1)
        ),
    )
    config.input.add(name=input_name, data_type=model_config_pb2.TYPE_FP32, dims=list(dims))
    config.output.add(
        name=output_name,
        data_type=model_config_pb2.TYPE_FP32,
        dims=[num_classes],
        label_filename=label_filename,
    )
    batching = config.dynamic_batching
    batching.max_queue_delay_microseconds = max_queue_delay_us
    batching.default_queue_policy.max_queue_size = max_queue_size
    batching.default_queue_policy.default_timeout_microseconds = request_timeout_us
    config.instance_group.add(
        kind=model_config_pb2.ModelInstanceGroup.KIND_AUTO, count=instance_count
    )
    return config


@dataclass(frozen=True)
class ServingConfig:
    """What the service takes from a config.pbtxt (after environment overrides).

    ``max_queue_size`` None: no limit (Triton's 0); ``request_timeout_s`` None: none (Triton's 0).
    """

    max_batch_size: int
    max_queue_delay_s: float
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int | None
    request_timeout_s: float | None
    instance_count: int
    version_policy: VersionPolicy

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch_size < 1:
            problems.append(
                f"max_batch_size must be 1 or more (the service batches along the first axis), "
                f"got {self.max_batch_size}"
            )
        if self.max_queue_delay_s < 0:
            problems.append(f"max_queue_delay_s must be 0 or more, got {self.max_queue_delay_s}")
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                problems.append(
                    f"preferred_batch_sizes must lie in 1..max_batch_size={self.max_batch_size}, "
                    f"got {size}"
                )
        if self.max_queue_size is not None and self.max_queue_size < 1:
            problems.append(f"max_queue_size must be 1 or more, got {self.max_queue_size}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            problems.append(f"request_timeout_s must be above 0, got {self.request_timeout_s}")
        if self.instance_count < 1:
            problems.append(f"instance_count must be 1 or more, got {self.instance_count}")
        for name, most in LIMITS.items():
            value = getattr(self, name)
            if value is not None and value > most:
                problems.append(f"{name} must be at most {most:g}, got {value:g}")
        problems += _policy_problems(self.version_policy)
        if problems:
            raise ModelConfigError("; ".join(problems))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _policy_problems(policy: object) -> list[str]:
    kind = policy[0] if isinstance(policy, tuple) and policy else None
    if kind == "latest" and len(policy) == 2 and _positive_int(policy[1]):
        return []
    versions = policy[1] if kind == "specific" and len(policy) == 2 else None
    if isinstance(versions, tuple) and versions and all(_positive_int(v) for v in versions):
        return []
    if kind == "all" and len(policy) == 1:
        return []
    return [
        "version_policy must be ('latest', n >= 1), ('specific', (versions >= 1, ...)) or "
        f"('all',), got {policy!r}"
    ]


def _version_policy(config: ModelConfig) -> VersionPolicy:
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return ("all",)
    if choice == "specific":
        return ("specific", tuple(int(v) for v in policy.specific.versions))
    if choice == "latest":
        return ("latest", int(policy.latest.num_versions))
    return ("latest", 1)  # Triton's default


def serving_config(
    model_config: ModelConfig, overrides: Mapping[str, object] | None = None
) -> ServingConfig:
    """The service's settings from ``model_config``; each ``overrides`` entry that is not None wins.

    Without ``dynamic_batching`` the model still runs in batches of what is already queued, with
    no delay to wait for more. An instance group without ``count`` counts 1 (Triton's ONNX Runtime
    backend would start 2 on the CPU). ``allow_timeout_override`` and priority levels are ignored.
    """
    batching = model_config.dynamic_batching
    queue = batching.default_queue_policy
    counts = [group.count or 1 for group in model_config.instance_group]
    values = {
        "max_batch_size": int(model_config.max_batch_size),
        "max_queue_delay_s": batching.max_queue_delay_microseconds / 1e6,
        "preferred_batch_sizes": tuple(int(s) for s in batching.preferred_batch_size),
        "max_queue_size": int(queue.max_queue_size) or None,
        "request_timeout_s": queue.default_timeout_microseconds / 1e6 or None,
        "instance_count": sum(counts) if counts else 1,
        "version_policy": _version_policy(model_config),
    }
    source = f"config of model {model_config.name!r}" if model_config.name else "model config"
    names = {field.name for field in fields(ServingConfig)}
    unknown = sorted(set(overrides or {}) - names)
    if unknown:
        raise ModelConfigError(
            f"{source}: unknown serving settings {unknown}; known: {sorted(names)}"
        )
    chosen = {key: value for key, value in (overrides or {}).items() if value is not None}
    if chosen:
        source += f" with overrides {chosen}"
    try:
        return ServingConfig(**{**values, **chosen})
    except ModelConfigError as error:
        raise ModelConfigError(f"{source}: {error}") from error


def select_versions(policy: VersionPolicy, available: Sequence[int]) -> list[int]:
    """The versions to serve, ascending, by Triton's rules: ``latest`` n the n highest available,
    ``specific`` those listed that are available (a listed one that is missing is skipped),
    ``all`` every one available."""
    problems = _policy_problems(policy)
    if problems:
        raise ModelConfigError(problems[0])
    present = sorted(set(available))
    if policy[0] == "all":
        return present
    if policy[0] == "specific":
        return [v for v in present if v in set(policy[1])]
    return present[-policy[1] :] if present else []


# A candidate version, tried on live traffic before it takes it: vitserve's own parameters in a
# config.pbtxt (Triton keeps a model's ``parameters`` for its backend and ignores those it does not
# know). ``vitserve_live_version`` pins the version unversioned requests get (promotion writes it).
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
CANDIDATE_PARAMETERS = (CANDIDATE_VERSION, SHADOW_PERCENT, CANARY_PERCENT)
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
    policy = _version_policy(config)
    served = select_versions(policy, [v for v in available if v != candidate])
    live = plan.live_version if plan.live_version in served else (max(served) if served else None)
    if live is None:
        raise ModelConfigError(
            f"model {config.name!r} serves no version to try version {candidate} against; export "
            "it without --candidate"
        )
    trial = CandidatePlan(
        live_version=live,
        candidate_version=candidate,
        shadow_percent=plan.shadow_percent or 100.0,
        canary_percent=plan.canary_percent,
        shadow_queue_size=plan.shadow_queue_size,
        shadow_timeout_s=plan.shadow_timeout_s,
        promote_min_requests=plan.promote_min_requests,
        promote_min_agreement=plan.promote_min_agreement,
        promote_max_latency_ratio=plan.promote_max_latency_ratio,
        promote_max_p99_difference=plan.promote_max_p99_difference,
    )
    copy = with_candidate_plan(config, trial)
    if policy[0] != "all":
        copy.version_policy.specific.versions[:] = sorted({*served, candidate})
    return copy
