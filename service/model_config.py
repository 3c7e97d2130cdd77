"""TEMPORARY stand-in (replaced by the onnx branch's module at merge)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig


@dataclass(frozen=True)
class ServingConfig:
    max_batch_size: int = 32
    max_queue_delay_s: float = 0.002
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 512
    request_timeout_s: float = 30.0
    instance_count: int = 1
    version_policy: tuple = ("latest", 1)


def read_model_config(path: Path) -> ModelConfig:
    return text_format.Parse(Path(path).read_text(), ModelConfig())


def serving_config(config: ModelConfig, overrides: Mapping[str, object]) -> ServingConfig:
    values: dict = {}
    if config.max_batch_size:
        values["max_batch_size"] = config.max_batch_size
    if config.HasField("dynamic_batching"):
        values["max_queue_delay_s"] = config.dynamic_batching.max_queue_delay_microseconds / 1e6
    count = sum(group.count for group in config.instance_group)
    if count:
        values["instance_count"] = count
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "all":
        values["version_policy"] = ("all",)
    elif kind == "specific":
        values["version_policy"] = ("specific", list(policy.specific.versions))
    elif kind == "latest":
        values["version_policy"] = ("latest", policy.latest.num_versions)
    return replace(ServingConfig(**values), **overrides)


def select_versions(policy: tuple, available: list[int]) -> list[int]:
    if policy[0] == "all":
        return sorted(available)
    if policy[0] == "specific":
        return sorted(v for v in available if v in policy[1])
    return sorted(available)[-policy[1] :]
