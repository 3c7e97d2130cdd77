"""Each model's serving settings: its ``config.pbtxt``, read and written as Triton's ``ModelConfig``.

The protobuf is Triton's own (``inference.ModelConfig``, generated code shipped in tritonclient), parsed
and printed with ``google.protobuf.text_format``: a file Triton would refuse (an unknown field, a wrong
enum) is refused here too, and a file written here is one Triton reads. :func:`serving_config` turns it
into the few settings the service uses; environment variables override them (``overrides``). The
``vitserve_`` parameters that try a candidate version are read in ``service/contract/candidate_plan.py``.
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


def version_policy(config: ModelConfig) -> VersionPolicy:
    """The config's version policy as a :data:`VersionPolicy` (Triton's default: the latest one)."""
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
        "version_policy": version_policy(model_config),
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
