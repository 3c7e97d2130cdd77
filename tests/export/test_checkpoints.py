"""Checkpoints are safetensors with the config in their metadata, and nothing else is loaded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from export.checkpoint import (
    CheckpointError,
    file_sha256,
    load_checkpoint,
    load_optimizer,
    read_metadata,
    save_checkpoint,
    save_optimizer,
)
from export.data import FASHION_MNIST_LABELS
from export.model import VisionTransformer


@pytest.mark.parametrize("position_embedding", ["learned", "sinusoidal"])
def test_save_and_load_give_the_same_model(tmp_path, tiny_config, position_embedding):
    config = tiny_config.replace(position_embedding=position_embedding, representation_size=16)
    torch.manual_seed(0)
    model = VisionTransformer(config)
    torch.nn.init.normal_(model.head.weight)
    run = tmp_path / "runs" / "new"  # not there yet: saving makes the directories
    path = run / "model.safetensors"
    save_checkpoint(model, path, "fashion-mnist", FASHION_MNIST_LABELS, epoch="3")
    loaded, metadata = load_checkpoint(run)  # a run directory means its model.safetensors
    assert loaded.config == config and not loaded.training
    assert metadata["format"] == "vitserve-checkpoint-1"  # the file format's version
    assert metadata["dataset"] == "fashion-mnist" and metadata["epoch"] == "3"
    assert json.loads(metadata["labels"]) == list(FASHION_MNIST_LABELS)
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[key], restored[key]) for key in original)
    images = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded(images), model.eval()(images), atol=0, rtol=0)
    assert [p.name for p in run.iterdir()] == ["model.safetensors"]  # no temporary file left
    # a later epoch saves into the same directory, over the same file
    save_checkpoint(model, path, "fashion-mnist", FASHION_MNIST_LABELS, epoch="4")
    assert load_checkpoint(run)[1]["epoch"] == "4"


class Payload:
    """Unpickling it creates ``marker``: proof that a file was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def write_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"weights": Payload(marker)}))


def write_torch_save(path: Path, marker: Path) -> None:
    """What ``torch.save`` writes: a zip archive around a pickle, which ``torch.load`` opens."""
    torch.save({"weights": Payload(marker)}, path)


# Every name under which a checkpoint reaches ``load_checkpoint``: the run directory (its
# model.safetensors), a resume directory's file, the names other tools give their weights, and none.
NAMES = [
    "model.safetensors",
    "run-directory",
    "last/model.safetensors",
    "model.pt",
    "model.pth",
    "checkpoint.pt",
    "model.ckpt",
    "pytorch_model.bin",
    "weights.pkl",
    "model",
]


@pytest.mark.parametrize("write", [write_pickle, write_torch_save], ids=["pickle", "torch-save"])
@pytest.mark.parametrize("name", NAMES)
def test_a_pickle_is_refused_under_any_name_without_being_unpickled(tmp_path, name, write):
    marker = tmp_path / "unpickled"
    if name == "run-directory":
        argument = tmp_path / "run"
        path = argument / "model.safetensors"
    else:
        argument = path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, marker)
    with pytest.raises(CheckpointError, match=rf"{path}: not a safetensors file .*never unpickled"):
        load_checkpoint(argument)
    assert not marker.exists(), f"{name} was unpickled"
    # the same bytes do run the payload when unpickled, so the check above can fail (a copy named
    # .pt: torch.load hands a file named .safetensors to safetensors, whatever it holds)
    probe = tmp_path / "probe.pt"
    shutil.copyfile(path, probe)
    with contextlib.suppress(RuntimeError):  # a bare pickle is no torch file, once unpickled
        torch.load(probe, weights_only=False)
    assert marker.exists()


def test_a_torch_save_file_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=rf"{path}: not a safetensors file"):
        load_checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"short", b'{"not": "safetensors"}' * 4])
def test_other_files_are_refused_with_their_path(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{path}: not a safetensors file"):
        load_checkpoint(path)


def test_missing_checkpoint_and_missing_metadata(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "absent.safetensors")
    path = tmp_path / "bare.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="lacks 'config'; not a vitserve checkpoint"):
        load_checkpoint(path)


def save_with_config(path: Path, tiny_config, config: str) -> None:
    """The tiny model's weights, saved with ``config`` as the metadata's config."""
    state = {k: v.contiguous() for k, v in VisionTransformer(tiny_config).state_dict().items()}
    labels = json.dumps(list(FASHION_MNIST_LABELS))
    metadata = {"config": config, "dataset": "fashion-mnist", "labels": labels}
    save_file(state, str(path), metadata=metadata)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, tiny_config):
    path = tmp_path / "model.safetensors"
    save_with_config(path, tiny_config, tiny_config.replace(dim=64).to_json())
    with pytest.raises(CheckpointError, match="weights do not fit the config"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda state: state.pop("blocks.1.mlp.fc2.bias"), "Missing key(s) in state_dict: "),
        (lambda state: state.update(extra=torch.zeros(3)), "Unexpected key(s) in state_dict: "),
    ],
)
def test_a_missing_or_extra_weight_is_refused_with_its_name(tmp_path, tiny_config, change, named):
    path = tmp_path / "model.safetensors"
    model = VisionTransformer(tiny_config)
    save_checkpoint(model, path, "fashion-mnist", FASHION_MNIST_LABELS)
    state = load_file(str(path))
    change(state)
    metadata = read_metadata(path)
    save_file(state, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="weights do not fit the config") as error:
        load_checkpoint(path)
    name = "blocks.1.mlp.fc2.bias" if "Missing" in named else "extra"
    assert f'{named}"{name}"' in str(error.value)


def test_a_config_that_is_not_a_vit_config_is_refused_with_its_path(tmp_path, tiny_config):
    path = tmp_path / "model.safetensors"
    for config in ("{not json", json.dumps({"dim": "wide"})):
        save_with_config(path, tiny_config, config)
        with pytest.raises(CheckpointError, match=rf"{path}: bad config in metadata \("):
            load_checkpoint(path)


def test_file_sha256_is_the_sha256_of_the_whole_file(tmp_path):
    """Over several of its 1 MiB blocks and a partial last one."""
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, size=3 * 2**20 + 12345, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    assert file_sha256(path) == hashlib.sha256(data.tobytes()).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_sha256(empty) == hashlib.sha256(b"").hexdigest()


def test_the_optimizer_state_survives_a_save_and_load(tmp_path, tiny_config, monkeypatch):
    """AdamW's moments, step counts and parameter groups, as a resumed run needs them."""
    monkeypatch.chdir(tmp_path)  # a file written anywhere but the path given shows up below
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config)
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.05},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(4, 1, 28, 28)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "optimizer.safetensors"
    save_optimizer(optimizer, path)
    restored = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": 0.0} for g in groups], lr=1.0
    )
    load_optimizer(restored, path)
    original, loaded = optimizer.state_dict(), restored.state_dict()
    # the groups travel as JSON, where a tuple (AdamW's betas) becomes a list
    assert loaded["param_groups"] == json.loads(json.dumps(original["param_groups"]))
    assert original["state"].keys() == loaded["state"].keys() and len(original["state"]) > 1
    for index, values in original["state"].items():
        assert values.keys() == loaded["state"][index].keys()
        for name, value in values.items():
            torch.testing.assert_close(loaded["state"][index][name], value, atol=0, rtol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["optimizer.safetensors"]
