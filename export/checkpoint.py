"""Checkpoints as safetensors with the config in their metadata: self-describing, never a pickle."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from export.config import ViTConfig
from export.data import spec_from_metadata
from export.dataset_spec import DatasetSpec
from export.model import VisionTransformer


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(
    model: VisionTransformer, path: Path, dataset: str, labels: tuple[str, ...], **extra: str
) -> None:
    metadata = {
        "format": "vitserve-checkpoint-1",
        "config": model.config.to_json(),
        "dataset": dataset,
        "labels": json.dumps(list(labels)),
        **extra,
    }
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(state, str(tmp), metadata=metadata)
    tmp.replace(path)


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory means its best weights, ``model.safetensors``."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return path


def read_metadata(path: Path) -> dict[str, str]:
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (too short)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(
            f"{path}: not a safetensors file ({error}); checkpoints are only read as safetensors, "
            "never unpickled"
        ) from error
    for key in ("config", "dataset", "labels"):
        if key not in metadata:
            raise CheckpointError(
                f"{path}: safetensors metadata lacks {key!r}; not a vitserve checkpoint"
            )
    return metadata


def load_checkpoint(path: str | Path) -> tuple[VisionTransformer, dict[str, str]]:
    """The model (eval mode) and the checkpoint's metadata."""
    path = resolve_checkpoint(path)
    metadata = read_metadata(path)
    try:
        config = ViTConfig.from_dict(json.loads(metadata["config"]))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{path}: bad config in metadata ({error})") from error
    model = VisionTransformer(config)
    state = load_file(str(path))
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise CheckpointError(f"{path}: weights do not fit the config ({error})") from error
    return model.eval(), metadata


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A vitserve run's checkpoint as an export reads it: the file, the model, and the dataset and
    labels its metadata names."""

    path: Path
    model: VisionTransformer
    spec: DatasetSpec
    labels: list[str]


def load_trained(checkpoint: str | Path) -> TrainedCheckpoint:
    """``checkpoint`` (a file, or a run directory: ``resolve_checkpoint``) with its metadata read."""
    path = resolve_checkpoint(checkpoint)
    model, metadata = load_checkpoint(path)
    return TrainedCheckpoint(
        path, model, spec_from_metadata(metadata), json.loads(metadata["labels"])
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Adam(W) state as tensors in safetensors, its scalars and groups as JSON metadata."""
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().clone().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"param_groups": json.dumps(state["param_groups"])})
    tmp.replace(path)


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    with safe_open(str(path), framework="pt") as handle:
        groups = json.loads(handle.metadata()["param_groups"])
    tensors = load_file(str(path))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
