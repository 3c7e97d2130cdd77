"""The training loop: optimizer, schedule, evaluation, checkpoints, early stopping, resuming.

AdamW (weight decay on matrices only), linear warmup then cosine decay, label smoothing, gradient
clipping, early stopping on validation loss, a resumable checkpoint every epoch, bf16 autocast on CUDA.
``model.safetensors`` holds the epoch of lowest validation loss (``keep="best"``) or the last one
(``keep="last"``, a folder's default: docs/training.md).
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from export.augment import augmentation_for
from export.checkpoint import load_optimizer, save_checkpoint, save_optimizer
from export.data import FOLDER, DatasetSpec, Split, normalize, spec_to_json
from export.finetune import adapt, load_parent
from export.model import VisionTransformer
from export.schedule import cosine_learning_rate
from export.teacher import distillation_loss
from export.train_settings import TrainSettings

if TYPE_CHECKING:
    from export.tensorboard_log import TensorBoardLog

METRIC_FIELDS = (
    "epoch",
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "learning_rate",
    "seconds",
)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def configure_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """Weight decay on parameters with 2+ dims only, not on biases or norms.

    The class token and the learned position table are stored as (1, n, dim), so they are decayed too
    (as nanoGPT decays its embeddings).
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.learning_rate,
        betas=(0.9, 0.999),
    )


def learning_rate_at(
    step: int, total_steps: int, warmup_steps: int, settings: TrainSettings
) -> float:
    return cosine_learning_rate(
        step, total_steps, warmup_steps, settings.learning_rate, settings.min_learning_rate
    )


@torch.inference_mode()
def evaluate_split(
    model: VisionTransformer,
    split: Split,
    spec: DatasetSpec,
    device: torch.device,
    batch_size: int = 512,
    label_smoothing: float = 0.0,
) -> tuple[float, float, torch.Tensor]:
    """(mean loss, accuracy, predictions) of a model on a split."""
    model.eval()
    total_loss, predictions = 0.0, []
    for start in range(0, len(split), batch_size):
        images = normalize(split.images[start : start + batch_size], spec).to(device)
        labels = split.labels[start : start + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(images).float()
        total_loss += F.cross_entropy(
            logits, labels, reduction="sum", label_smoothing=label_smoothing
        ).item()
        predictions.append(logits.argmax(dim=1).cpu())
    predicted = torch.cat(predictions)
    accuracy = (predicted == split.labels).float().mean().item()
    return total_loss / len(split), accuracy, predicted


class Trainer:
    def __init__(self, settings: TrainSettings, out_dir: Path, spec: DatasetSpec) -> None:
        self.settings = settings
        self.teacher: torch.nn.Module | None = None
        self.out_dir = out_dir
        self.device = pick_device()
        self.spec = spec
        config = settings.config()
        if (config.in_channels, config.image_height, config.image_width) != (
            spec.channels,
            spec.height,
            spec.width,
        ) or config.num_classes != len(spec.labels):
            raise ValueError(
                f"the model takes {config.in_channels}x{config.image_height}x{config.image_width} "
                f"images into {config.num_classes} classes, {spec.name} holds {spec.channels}x"
                f"{spec.height}x{spec.width} images in {len(spec.labels)} classes"
            )
        torch.manual_seed(settings.seed)
        self.model = VisionTransformer(config).to(self.device)
        self.optimizer = configure_optimizer(self.model, settings)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.epoch = 0
        self.step = 0
        self.best_val_loss = math.inf
        self.epochs_without_improvement = 0

    def use_teacher(self, teacher: torch.nn.Module | None) -> None:
        """Distil ``teacher`` (export/teacher.py) into the model; None trains on the labels alone."""
        self.teacher = teacher.to(self.device).eval() if teacher is not None else None

    # -- persistence -------------------------------------------------------------------------
    @property
    def resume_dir(self) -> Path:
        return self.out_dir / "last"

    def save_state(self) -> None:
        self.resume_dir.mkdir(parents=True, exist_ok=True)
        save_checkpoint(self.model, self.resume_dir / "model.safetensors", **self.described())
        save_optimizer(self.optimizer, self.resume_dir / "optimizer.safetensors")
        state = {
            "epoch": self.epoch,
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "epochs_without_improvement": self.epochs_without_improvement,
            "generator_state": self.generator.get_state().tolist(),
            "torch_rng_state": torch.get_rng_state().tolist(),
            "settings": asdict(self.settings),
        }
        tmp = self.resume_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.resume_dir / "state.json")

    def described(self) -> dict[str, str | tuple[str, ...]]:
        """What a checkpoint says about the data: a folder dataset's spec travels with it."""
        extra = {"dataset_spec": spec_to_json(self.spec)} if self.spec.name == FOLDER else {}
        return {"dataset": self.spec.name, "labels": self.spec.labels, **extra}

    def load_state(self, resume_dir: Path) -> None:
        from safetensors.torch import load_file

        state = json.loads((resume_dir / "state.json").read_text())
        self.trim_metrics(after_epoch=state["epoch"])
        self.model.load_state_dict(load_file(str(resume_dir / "model.safetensors")))
        load_optimizer(self.optimizer, resume_dir / "optimizer.safetensors")
        self.epoch = state["epoch"]
        self.step = state["step"]
        self.best_val_loss = state["best_val_loss"]
        self.epochs_without_improvement = state["epochs_without_improvement"]
        self.generator.set_state(torch.tensor(state["generator_state"], dtype=torch.uint8))
        torch.set_rng_state(torch.tensor(state["torch_rng_state"], dtype=torch.uint8))

    def load_initial_weights(self, checkpoint: Path, fine_tune: bool = False) -> None:
        """Weights of a trained checkpoint: of this run's architecture and dataset for a warm
        restart, or (``fine_tune``) of another dataset, adapted to this one's."""
        model, metadata = load_parent(checkpoint)
        if fine_tune:
            same_classes = json.loads(metadata["labels"]) == list(self.spec.labels)
            adapted = adapt(model, self.model, same_classes)
            print(f"fine-tuning {checkpoint}: {'; '.join(adapted) or 'nothing to adapt'}")
            return
        if model.config != self.model.config:
            raise ValueError(
                f"{checkpoint} holds a different model ({model.config.to_json()}) than preset "
                f"{self.settings.preset!r} with this run's model flags on {self.spec.name} "
                f"({self.model.config.to_json()}); pass the preset and flags it was trained with"
            )
        if metadata.get("dataset") != self.spec.name:
            raise ValueError(
                f"{checkpoint} was trained on {metadata.get('dataset')!r}, not {self.spec.name!r}"
            )
        self.model.load_state_dict(model.state_dict())

    def trim_metrics(self, after_epoch: int) -> None:
        """Drops the rows of epochs after the saved state: an epoch writes its row before its state,
        so a run stopped in between would otherwise list that epoch twice once resumed."""
        path = self.out_dir / "metrics.csv"
        if not path.exists():
            return
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        kept = [row for row in rows if int(row["epoch"]) <= after_epoch]
        if len(kept) < len(rows):
            with path.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=METRIC_FIELDS)
                writer.writeheader()
                writer.writerows(kept)

    def append_metrics(self, row: dict) -> None:
        path = self.out_dir / "metrics.csv"
        new = not path.exists()
        with path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=METRIC_FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(row)

    # -- training ----------------------------------------------------------------------------
    def fit(self, train: Split, validation: Split) -> None:
        """Epochs until ``epochs`` or early stopping; with ``tensorboard``, logs and then the
        attention images of the final weights on validation images."""
        log = None
        if self.settings.tensorboard:
            from export.tensorboard_log import TensorBoardLog

            # Resumed: what the stopped run logged after its saved state (later steps) is dropped.
            log = TensorBoardLog(self.out_dir / "tensorboard", purge_step=self.step + 1)
        try:
            self.run_epochs(train, validation, log)
            if log is not None:
                log.attention(self.step, self.model, validation, self.spec)
        finally:
            if log is not None:
                log.close()

    def loss(
        self,
        images: torch.Tensor,
        logits: torch.Tensor,
        distillation_logits: torch.Tensor | None,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """Cross-entropy with the labels, or with a teacher the distillation loss (its distillation
        term on the distillation head's logits when the model has a distillation token)."""
        smoothing = self.settings.label_smoothing
        if self.teacher is None:
            loss = F.cross_entropy(logits, labels, label_smoothing=smoothing)
            if distillation_logits is None:
                return loss
            # A distillation token and no teacher (a distilled model fine-tuned on other images):
            # its head learns the labels too.
            labelled = F.cross_entropy(distillation_logits, labels, label_smoothing=smoothing)
            return (loss + labelled) / 2
        with torch.no_grad():
            teacher_logits = self.teacher(images).float()
        kind = self.settings.distillation
        return distillation_loss(
            logits, teacher_logits, labels, kind, smoothing, distillation_logits
        )

    def run_epochs(self, train: Split, validation: Split, log: TensorBoardLog | None) -> None:
        s = self.settings
        steps_per_epoch = len(train) // s.batch_size
        if steps_per_epoch == 0:
            raise ValueError(f"batch size {s.batch_size} exceeds the {len(train)} training images")
        total_steps = s.steps or steps_per_epoch * s.epochs
        warmup_steps = max(1, int(s.warmup_epochs * steps_per_epoch))
        augment = augmentation_for(self.spec, s.hflip, s.erase) if s.augment else None
        # Both heads' logits: the class head's and, with a distillation token, its head's.
        forward = torch.compile(self.model.forward_heads) if s.compile else self.model.forward_heads
        use_bf16 = self.device.type == "cuda"
        while self.epoch < s.epochs and self.step < total_steps:
            if self.epochs_without_improvement >= s.patience:
                print(f"early stop: validation loss has not improved for {s.patience} epochs")
                break
            started = time.perf_counter()
            self.model.train()
            order = torch.randperm(len(train), generator=self.generator)
            loss_sum, correct, seen = 0.0, 0, 0
            bar = tqdm(
                range(min(steps_per_epoch, total_steps - self.step)),
                desc=f"epoch {self.epoch + 1}/{s.epochs}",
                mininterval=5.0,
                file=sys.stderr,
            )
            for batch_index in bar:
                indices = order[batch_index * s.batch_size : (batch_index + 1) * s.batch_size]
                images = normalize(train.images[indices], self.spec)
                if augment is not None:
                    images = augment(images, self.generator)
                images, labels = images.to(self.device), train.labels[indices].to(self.device)
                lr = learning_rate_at(self.step, total_steps, warmup_steps, s)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    logits, distillation_logits = forward(images)
                logits = logits.float()
                if distillation_logits is not None:
                    distillation_logits = distillation_logits.float()
                loss = self.loss(images, logits, distillation_logits, labels)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if s.clip_grad_norm:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip_grad_norm)
                self.optimizer.step()
                self.step += 1
                if log is not None:
                    log.step(self.step, loss.item(), lr)
                loss_sum += loss.item() * len(labels)
                if distillation_logits is not None:  # the model's logits: the mean of its heads'
                    logits = (logits + distillation_logits) / 2
                correct += (logits.argmax(dim=1) == labels).sum().item()
                seen += len(labels)
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}", lr=f"{lr:.2e}", refresh=False)
            bar.close()
            val_loss, val_accuracy, _ = evaluate_split(
                self.model, validation, self.spec, self.device, label_smoothing=s.label_smoothing
            )
            self.epoch += 1
            row = {
                "epoch": self.epoch,
                "train_loss": round(loss_sum / seen, 6),
                "train_accuracy": round(correct / seen, 6),
                "val_loss": round(val_loss, 6),
                "val_accuracy": round(val_accuracy, 6),
                "learning_rate": lr,
                "seconds": round(time.perf_counter() - started, 2),
            }
            self.append_metrics(row)
            if log is not None:
                log.epoch(self.step, row)
            print(json.dumps(row), flush=True)
            improved = val_loss < self.best_val_loss
            if improved:
                self.best_val_loss = val_loss
                self.epochs_without_improvement = 0
            else:
                self.epochs_without_improvement += 1
            if improved or s.keep == "last":
                save_checkpoint(
                    self.model,
                    self.out_dir / "model.safetensors",
                    **self.described(),
                    epoch=str(self.epoch),
                    val_loss=f"{val_loss:.6f}",
                    val_accuracy=f"{val_accuracy:.6f}",
                )
            self.save_state()
