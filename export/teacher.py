"""A small CNN teacher for DeiT-style distillation (Touvron et al., 2021), and the distillation loss.

A ViT trained from scratch on a few thousand images lacks the convolution's built-in locality; a CNN
trained on the same split learns fast, and its predictions, used as a second target, carry that bias
over to the ViT. ``--teacher auto`` trains one first (``RUN_DIR/teacher.safetensors``); ``--teacher
PATH`` reuses it. Only the ViT is exported and served.

The ViT is trained on the mean of the cross-entropy with the labels and a distillation term. Soft
(the default): the Kullback-Leibler divergence from the teacher's distribution at temperature
``TEMPERATURE``. Hard: the cross-entropy with the teacher's predicted class. With a distillation
token (export/model.py) the term is its head's, the labels' the class head's. On 2,000
Fashion-MNIST images soft distillation without a token was best, and the only one to beat the ViT
trained alone; the teacher, trained on the same images, predicts 99.5% of them right, so its class
adds little to their labels, where its distribution does (docs/training.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from export.augment import Augmentation
from export.data import DatasetSpec, Split, normalize
from export.schedule import cosine_learning_rate

DISTILLATIONS = ("hard", "soft")
TEMPERATURE = 3.0
FORMAT = "vitserve-teacher-1"
TEACHER_FILE = "teacher.safetensors"  # in the run directory, for --teacher auto
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 5e-4


class TeacherCNN(nn.Module):
    """Five 3x3 conv-BN-ReLU layers in three stages (width, 2 x width, 4 x width), max-pooled between
    them, global average pooling and a linear head; images above 32 pixels start with a stride of 2."""

    def __init__(self, in_channels: int, num_classes: int, side: int, width: int = 16) -> None:
        super().__init__()
        self.hyper = {"in_channels": in_channels, "num_classes": num_classes, "side": side}
        self.hyper["width"] = width

        def conv(inputs: int, outputs: int, stride: int = 1) -> list[nn.Module]:
            layer = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
            return [layer, nn.BatchNorm2d(outputs), nn.ReLU(inplace=True)]

        w, stem = width, 2 if side > 32 else 1
        self.features = nn.Sequential(
            *conv(in_channels, w, stem),
            *conv(w, w),
            nn.MaxPool2d(2),
            *conv(w, 2 * w),
            *conv(2 * w, 2 * w),
            nn.MaxPool2d(2),
            *conv(2 * w, 4 * w),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def distillation_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    kind: str,
    label_smoothing: float,
    distillation_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Half the cross-entropy of ``logits`` with the labels, half the distillation term of ``kind``:
    of ``distillation_logits`` (a distillation token's head) when given, else of ``logits`` too."""
    supervised = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
    student = logits if distillation_logits is None else distillation_logits
    if kind == "hard":
        distilled = F.cross_entropy(student, teacher_logits.argmax(dim=1))
    elif kind == "soft":
        t = TEMPERATURE
        distilled = F.kl_div(
            F.log_softmax(student / t, dim=1),
            F.log_softmax(teacher_logits / t, dim=1),
            reduction="batchmean",
            log_target=True,
        ) * (t * t)
    else:
        raise ValueError(f"distillation must be one of {DISTILLATIONS}, got {kind!r}")
    return 0.5 * supervised + 0.5 * distilled


@torch.inference_mode()
def evaluate_teacher(model: nn.Module, split: Split, spec: DatasetSpec) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on a split."""
    model.eval()
    logits = torch.cat(
        [model(normalize(split.images[i : i + 500], spec)) for i in range(0, len(split), 500)]
    )
    loss = F.cross_entropy(logits, split.labels).item()
    return loss, (logits.argmax(dim=1) == split.labels).float().mean().item()


def train_teacher(
    train: Split,
    validation: Split,
    spec: DatasetSpec,
    augment: Augmentation | None,
    steps: int,
    batch_size: int,
    seed: int,
    path: Path,
) -> TeacherCNN:
    """Trains a teacher on ``train`` for ``steps`` steps (AdamW, cosine schedule) and saves its last
    weights to ``path``, with their validation figures and the time it took. The last, not the
    epoch of lowest validation loss: on 2,000 Fashion-MNIST images, 4,200 steps, they scored 85.81%
    on the 10,000 test images where that epoch's (step 2,184) scored 85.13% (docs/training.md)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = TeacherCNN(spec.channels, len(spec.labels), max(spec.height, spec.width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    per_epoch = max(1, len(train) // batch_size)
    warmup = max(1, steps // 20)
    step, started, cpu = 0, time.perf_counter(), time.process_time()
    model.train()
    while step < steps:
        order = torch.randperm(len(train), generator=generator)
        for index in range(min(per_epoch, steps - step)):
            chosen = order[index * batch_size : (index + 1) * batch_size]
            images = normalize(train.images[chosen], spec)
            if augment is not None:
                images = augment(images, generator)
            for group in optimizer.param_groups:
                group["lr"] = cosine_learning_rate(step, steps, warmup, LEARNING_RATE, 1e-5)
            loss = F.cross_entropy(model(images), train.labels[chosen], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    val_loss, val_accuracy = evaluate_teacher(model, validation, spec)
    figures = {
        "steps": steps,
        "val_loss": round(val_loss, 6),
        "val_accuracy": round(val_accuracy, 6),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
    }
    print(f"teacher: {json.dumps(figures)}", flush=True)
    save_teacher(model, path, spec.labels, figures)
    return model.eval()


def save_teacher(model: TeacherCNN, path: Path, labels: tuple[str, ...], figures: dict) -> None:
    metadata = {
        "format": FORMAT,
        "hyper": json.dumps(model.hyper),
        "labels": json.dumps(list(labels)),
        "figures": json.dumps(figures),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata)
    tmp.replace(path)


def teacher_metadata(path: Path) -> dict:
    """The metadata of a teacher file; ValueError naming the file when it is not one."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"--teacher {path}: not a teacher file ({error})") from error
    if metadata.get("format") != FORMAT:
        raise ValueError(f"--teacher {path}: not a teacher written by --teacher auto")
    return {key: json.loads(value) for key, value in metadata.items() if key != "format"}


def load_teacher(path: Path, spec: DatasetSpec) -> TeacherCNN:
    """A saved teacher, checked to take this dataset's images and predict its classes."""
    metadata = teacher_metadata(path)
    hyper, labels = metadata["hyper"], tuple(metadata["labels"])
    if labels != spec.labels or hyper["in_channels"] != spec.channels:
        raise ValueError(
            f"--teacher {path} takes {hyper['in_channels']}-channel images of the classes "
            f"{', '.join(labels)}; this run has {spec.channels}-channel images of "
            f"{', '.join(spec.labels)}"
        )
    model = TeacherCNN(**hyper)
    model.load_state_dict(load_file(str(path)))
    print(f"teacher {path}: {json.dumps(metadata['figures'])}", file=sys.stderr, flush=True)
    return model.eval()
