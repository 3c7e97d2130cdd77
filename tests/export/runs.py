"""Command lines of the tiny training runs the export tests make, and checkpoint tampering."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from export.checkpoint import load_checkpoint, save_checkpoint

# Every tiny run validates on the same 1,000 images, so a run may start from another's weights.
TINY_SPLIT = ("--validation-size", "1000", "--seed", "0", "--no-augment", "--no-report")


def tiny_run_args(preset: str, out: Path) -> list[str]:
    """Six epochs on 2,000 real Fashion-MNIST training images."""
    return [
        *("--preset", preset, "--dataset", "fashion-mnist", "--out", str(out)),
        *("--epochs", "6", "--batch-size", "50", "--lr", "3e-3", "--warmup-epochs", "1"),
        *("--train-limit", "2000", *TINY_SPLIT),
    ]


def shapes_run_args(data_dir: Path, out: Path) -> list[str]:
    """A tiny ViT with a linear patch embedding on 32 x 32 RGB: about 12 s of CPU for 30 epochs."""
    return [
        *("--dataset", "folder", "--data-dir", str(data_dir), "--image-size", "32"),
        *("--channels", "3", "--patch-size", "4", "--dim", "32", "--depth", "2", "--heads", "2"),
        *("--mlp-dim", "64", "--pooling", "mean", "--patch-embedding", "linear"),
        *("--epochs", "30", "--batch-size", "16", "--lr", "3e-3", "--warmup-epochs", "3"),
        *("--validation-size", "0.15", "--threads", "1", "--tensorboard", "--no-report"),
        *("--teacher", "none"),
        *("--out", str(out)),
    ]


def init_from_args(preset: str, parent: Path, out: Path, *extra: str) -> list[str]:
    """One epoch on 500 images, starting from ``parent``'s weights."""
    return [
        *("--preset", preset, "--init-from", str(parent), "--out", str(out)),
        *("--epochs", "1", "--batch-size", "50", "--lr", "1e-4", "--warmup-epochs", "0"),
        *("--train-limit", "500", *TINY_SPLIT, *extra),
    ]


def save_altered_copy(run: Path, target: Path) -> None:
    """Writes ``run``'s checkpoint with a changed head bias to ``target``: other weights, same shape."""
    model, metadata = load_checkpoint(run)
    with torch.no_grad():
        model.head.bias.add_(1.0)
    save_checkpoint(model, target, metadata["dataset"], tuple(json.loads(metadata["labels"])))
