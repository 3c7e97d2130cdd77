"""Shared fixtures: a tiny preset, one short training run on real Fashion-MNIST images, and one on a
folder of drawn shapes trained from the command line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from export import train
from export.config import PRESETS, ViTConfig
from export.sample_folders import write_shapes
from tests.export.runs import shapes_run_args, tiny_run_args
from tests.support import made_once, run_in_repo

REPO = Path(__file__).resolve().parents[2]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# 4x4 patches of 7 px: a forward pass costs next to nothing, and it still learns Fashion-MNIST.
TINY = ViTConfig(patch_size=7, dim=32, depth=2, heads=2, mlp_dim=64, pooling="token")
TINY_PRESET = "test-tiny"

# Another process may be training on this machine's cores: stay on one thread.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_config() -> ViTConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_preset():
    """Registers the ``test-tiny`` preset for the whole session (train.main reads PRESETS)."""
    PRESETS[TINY_PRESET] = TINY
    yield TINY_PRESET
    PRESETS.pop(TINY_PRESET, None)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_preset) -> Path:
    """A finished run: 2,000 real training images, 6 epochs, best weights in model.safetensors;
    trained once for every xdist worker (``made_once``): tests only read it, or a copy."""

    def make(directory: Path) -> None:
        assert train.main(tiny_run_args(tiny_preset, directory / "tiny")) == 0

    return made_once(tmp_path_factory, "tiny-run", make) / "tiny"


@pytest.fixture(scope="session")
def run_module():
    """``run_module("export.evaluate", *args)``: ``python -m`` from the repository root, as a user."""

    def run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        return run_in_repo(["-m", module, *args], env, timeout)

    return run


@pytest.fixture(scope="session")
def shapes_folders(tmp_path_factory) -> tuple[Path, Path]:
    """(training folder, held-out folder): circles, squares and triangles of mixed sizes and
    formats, 60 a class to train on (a fifth held out as the test split), 10 a class never seen;
    drawn once for every xdist worker."""

    def make(root: Path) -> None:
        write_shapes(root / "train", 60, seed=0)
        write_shapes(root / "held_out", 10, seed=1)

    root = made_once(tmp_path_factory, "shapes", make)  # one path: shapes_run records it
    return root / "train", root / "held_out"


@pytest.fixture(scope="session")
def shapes_run(tmp_path_factory, shapes_folders, run_module) -> Path:
    """``python -m export.train --dataset folder ...`` with architecture flags and --tensorboard;
    trained once for every xdist worker (``made_once``)."""

    def make(directory: Path) -> None:
        args = shapes_run_args(shapes_folders[0], directory / "shapes")
        completed = run_module("export.train", *args, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]

    return made_once(tmp_path_factory, "shapes-run", make) / "shapes"


def small(**changes) -> ViTConfig:
    """A ViT small enough to run in a test: 16 x 16 images, patches of 4, 2 layers of width 32."""
    values = {
        "image_height": 16,
        "image_width": 16,
        "patch_size": 4,
        "dim": 32,
        "depth": 2,
        "heads": 4,
        "mlp_dim": 64,
        **changes,
    }
    return ViTConfig(**values)
