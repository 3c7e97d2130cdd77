"""What the engine reports of its models: Triton's repository index, and its model configuration and
statistics extensions.

- The index: ``(name, version, state, reason)`` of every model version known; a model with no version
  known is listed once, with version None.

- The served ``ModelConfig`` as JSON, as Triton answers it (protobuf's JSON mapping with the proto field
  names, so 64-bit integers are strings): the model's ``config.pbtxt`` (or the defaults of a model without
  one) with the settings in force written in (the environment's overrides, the service's queue bounds)
  and, when the file names none, the input and output tensors of the version's metadata; then the
  encoded-image input the protocol takes beside the tensor (service/contract/model_config.py).
- ``model_stats``: one entry per ready version (service/engine/statistics.py says what is counted).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from service.contract.model_config import (
    PLATFORM,
    DataType,
    ModelConfig,
)
from service.engine.model_manager import ModelManager
from service.engine.model_versions import served_model_config
from service.engine.pipeline import ModelPipeline
from service.errors import NotFound


def _named_version(manager: ModelManager, name: str, version: int | None) -> None:
    model = manager.model(name)
    if version is not None and version not in model.versions:
        known = ", ".join(map(str, sorted(model.versions))) or "none"
        raise NotFound(f"unknown version '{version}' of model '{name}'; known versions: {known}")


def served_config(manager: ModelManager, name: str, version: int | None = None) -> dict[str, Any]:
    """The ModelConfig a model is served with, as JSON; 404 for an unknown model or version."""
    _named_version(manager, name, version)
    model = manager.model(name)
    config = served_model_config(model, version)
    config.name = name
    if not config.platform and not config.backend:
        config.platform = PLATFORM
    pipeline = model.pipeline(version)
    serving = pipeline.serving if pipeline is not None else model.serving
    if serving is not None:
        config.max_batch_size = serving.max_batch_size
        batching = config.dynamic_batching
        batching.max_queue_delay_microseconds = round(serving.max_queue_delay_s * 1e6)
        batching.preferred_batch_size[:] = serving.preferred_batch_sizes
        queue = batching.default_queue_policy
        queue.max_queue_size = serving.max_queue_size or 0
        queue.default_timeout_microseconds = round((serving.request_timeout_s or 0) * 1e6)
        if sum(group.count or 1 for group in config.instance_group) != serving.instance_count:
            del config.instance_group[:]
            config.instance_group.add(count=serving.instance_count)
    if pipeline is not None and not config.input and not config.output:
        meta = pipeline.metadata
        spec = meta.input
        config.input.add(
            name=spec.name,
            data_type=DataType.TYPE_FP32,
            dims=[spec.channels, spec.height, spec.width],
        )
        config.output.add(
            name=meta.outputs.logits, data_type=DataType.TYPE_FP32, dims=[meta.num_classes]
        )
    return config_dict(config)


def config_dict(config: ModelConfig) -> dict[str, Any]:
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def statistics(
    manager: ModelManager, name: str | None = None, version: int | None = None
) -> list[dict[str, Any]]:
    """Triton's ``model_stats``: every ready version of every model, of one model, or one version
    (404 when that version is not ready)."""
    pipelines: list[ModelPipeline] = []
    if name is None:
        names = sorted(manager.models)
    else:
        _named_version(manager, name, version)
        names = [name]
    for model_name in names:
        model = manager.models[model_name]
        versions = model.ready_versions() if version is None else [version]
        for number in versions:
            pipeline = model.pipeline(number)
            if pipeline is None:
                raise NotFound(
                    f"version {number} of model '{model_name}' is not ready, so it has no "
                    f"statistics; ready versions: {model.ready_versions() or 'none'}"
                )
            pipelines.append(pipeline)
    return [p.statistics.as_dict(p.name, str(p.version)) for p in pipelines]


def index(manager: ModelManager) -> list[tuple[str, int | None, str, str]]:
    """Triton's repository index: every model of the repository and every version known."""
    rows: list[tuple[str, int | None, str, str]] = []
    for name in sorted(manager.known_names()):
        model = manager.models.get(name)
        if model is None or not model.versions:
            unloaded = manager.explicit or (model is not None and model.unloaded)
            reason = "unloaded" if unloaded else "not loaded"
            reason = model.config_problem if model is not None and model.config_problem else reason
            rows.append((name, None, "UNAVAILABLE", reason))
            continue
        rows.extend(
            (name, v, status.state, status.reason) for v, status in sorted(model.versions.items())
        )
    return rows
