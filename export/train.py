"""Train a ViT on a real dataset: ``python -m export.train --preset fashion-small --out runs/NAME``.

AdamW (weight decay on matrices only), linear warmup then cosine decay, label smoothing, gradient
clipping, early stopping on validation loss, a resumable checkpoint every epoch, bf16 autocast on CUDA.

``--init-from CHECKPOINT`` starts a new run (its own schedule, a fresh optimizer) from trained weights:
a warm restart of the learning rate, the way to train a finished run for longer.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from export.checkpoint import (
    CheckpointError,
    file_sha256,
    load_checkpoint,
    load_optimizer,
    resolve_checkpoint,
    save_checkpoint,
    save_optimizer,
)
from export.config import PRESETS, get_preset
from export.data import (
    DATASETS,
    DatasetError,
    DatasetSpec,
    Split,
    augmentation_for,
    get_dataset_spec,
    load_dataset,
    normalize,
    train_validation_split,
)
from export.model import VisionTransformer

METRIC_FIELDS = (
    "epoch",
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "learning_rate",
    "seconds",
)


@dataclass(frozen=True)
class TrainSettings:
    preset: str = "fashion-small"
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    epochs: int = 50
    batch_size: int = 128
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 3.0
    label_smoothing: float = 0.1
    clip_grad_norm: float = 1.0
    patience: int = 12
    validation_size: int = 5000
    train_limit: int | None = None
    seed: int = 0
    threads: int | None = None
    compile: bool = False
    augment: bool = True
    init_from: str | None = None
    # Recorded, not a flag: which weights ``init_from`` held when this run started.
    init_from_sha256: str | None = None


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
    if step < warmup_steps:
        return settings.learning_rate * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return (
        settings.min_learning_rate + (settings.learning_rate - settings.min_learning_rate) * cosine
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
    def __init__(self, settings: TrainSettings, out_dir: Path) -> None:
        self.settings = settings
        self.out_dir = out_dir
        self.device = pick_device()
        self.spec = get_dataset_spec(settings.dataset)
        config = get_preset(settings.preset)
        if (config.in_channels, config.image_height, config.image_width) != (
            self.spec.channels,
            self.spec.height,
            self.spec.width,
        ):
            config = config.replace(
                in_channels=self.spec.channels,
                image_height=self.spec.height,
                image_width=self.spec.width,
            )
        config = config.replace(num_classes=len(self.spec.labels))
        torch.manual_seed(settings.seed)
        self.model = VisionTransformer(config).to(self.device)
        self.optimizer = configure_optimizer(self.model, settings)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.epoch = 0
        self.step = 0
        self.best_val_loss = math.inf
        self.epochs_without_improvement = 0

    # -- persistence -------------------------------------------------------------------------
    @property
    def resume_dir(self) -> Path:
        return self.out_dir / "last"

    def save_state(self) -> None:
        self.resume_dir.mkdir(parents=True, exist_ok=True)
        save_checkpoint(
            self.model, self.resume_dir / "model.safetensors", self.spec.name, self.spec.labels
        )
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

    def load_initial_weights(self, checkpoint: Path) -> None:
        """Weights of a trained checkpoint whose architecture is this run's, for a warm restart."""
        model, metadata = load_checkpoint(checkpoint)
        if model.config != self.model.config:
            raise ValueError(
                f"{checkpoint} holds a different model ({model.config.to_json()}) than preset "
                f"{self.settings.preset!r} on {self.spec.name} "
                f"({self.model.config.to_json()}); pass the preset it was trained with"
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
        s = self.settings
        steps_per_epoch = len(train) // s.batch_size
        if steps_per_epoch == 0:
            raise ValueError(f"batch size {s.batch_size} exceeds the {len(train)} training images")
        total_steps = steps_per_epoch * s.epochs
        warmup_steps = max(1, int(s.warmup_epochs * steps_per_epoch))
        augment = augmentation_for(self.spec) if s.augment else None
        step_model = torch.compile(self.model) if s.compile else self.model
        use_bf16 = self.device.type == "cuda"
        while self.epoch < s.epochs:
            if self.epochs_without_improvement >= s.patience:
                print(f"early stop: validation loss has not improved for {s.patience} epochs")
                break
            started = time.perf_counter()
            self.model.train()
            order = torch.randperm(len(train), generator=self.generator)
            loss_sum, correct, seen = 0.0, 0, 0
            bar = tqdm(
                range(steps_per_epoch),
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
                    logits = step_model(images)
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=s.label_smoothing)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if s.clip_grad_norm:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip_grad_norm)
                self.optimizer.step()
                self.step += 1
                loss_sum += loss.item() * len(labels)
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
            print(json.dumps(row), flush=True)
            if val_loss < self.best_val_loss:
                self.best_val_loss = val_loss
                self.epochs_without_improvement = 0
                save_checkpoint(
                    self.model,
                    self.out_dir / "model.safetensors",
                    self.spec.name,
                    self.spec.labels,
                    epoch=str(self.epoch),
                    val_loss=f"{val_loss:.6f}",
                    val_accuracy=f"{val_accuracy:.6f}",
                )
            else:
                self.epochs_without_improvement += 1
            self.save_state()


def parse_args(argv: list[str] | None = None) -> tuple[TrainSettings, Path, Path | None, bool]:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python -m export.train", description=__doc__)
    parser.add_argument("--preset", default=defaults.preset, choices=sorted(PRESETS))
    parser.add_argument("--dataset", default=defaults.dataset, choices=sorted(DATASETS))
    parser.add_argument("--data-dir", default=None, help="directory of the dataset's files")
    parser.add_argument(
        "--out", type=Path, default=None, help="run directory to write (a new run needs one)"
    )
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, dest="learning_rate")
    parser.add_argument(
        "--min-lr", type=float, default=defaults.min_learning_rate, dest="min_learning_rate"
    )
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--warmup-epochs", type=float, default=defaults.warmup_epochs)
    parser.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing)
    parser.add_argument("--clip-grad-norm", type=float, default=defaults.clip_grad_norm)
    parser.add_argument("--patience", type=int, default=defaults.patience)
    parser.add_argument("--validation-size", type=int, default=defaults.validation_size)
    parser.add_argument(
        "--train-limit", type=int, default=None, help="use only the first N training images"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
    parser.add_argument("--no-augment", action="store_false", dest="augment")
    parser.add_argument("--resume", type=Path, default=None, help="run directory to continue")
    parser.add_argument(
        "--init-from",
        default=None,
        help="start from the weights of this checkpoint (or run directory) with a new schedule",
    )
    parser.add_argument(
        "--no-report", action="store_true", help="skip the plots and test evaluation"
    )
    args = vars(parser.parse_args(argv))
    if args["resume"] is not None and args["init_from"] is not None:
        parser.error(
            "--resume continues a run with the weights it has; --init-from starts a new one"
        )
    if args["resume"] is None and args["out"] is None:
        parser.error("--out RUN_DIR is required for a new run (--resume RUN_DIR continues one)")
    out, resume, no_report = args.pop("out"), args.pop("resume"), args.pop("no_report")
    return TrainSettings(**args), out, resume, no_report


def check_same_validation_split(settings: TrainSettings, checkpoint: Path) -> None:
    """Refuse a parent run whose training images include this run's validation images."""
    parent_settings = checkpoint.parent / "settings.json"
    if not parent_settings.is_file():
        raise ValueError(
            f"{checkpoint}: no settings.json beside it, so its validation split is unknown and "
            "this run's validation images may have been trained on; start from a run directory"
        )
    parent = json.loads(parent_settings.read_text())
    for key in ("dataset", "validation_size", "seed"):
        if parent.get(key) != getattr(settings, key):
            raise ValueError(
                f"{checkpoint} was trained with {key}={parent.get(key)!r}, this run has "
                f"{key}={getattr(settings, key)!r}: the validation split would differ and include "
                "images the checkpoint was trained on"
            )


def refuse_existing_run(out_dir: Path) -> None:
    """A new run never writes into the directory of a run that has weights. One that has none (it
    stopped before its first epoch was saved) holds nothing to lose, and is started over."""
    taken = [name for name in ("model.safetensors", "last") if (out_dir / name).exists()]
    if taken:
        raise ValueError(
            f"{out_dir} already holds a run ({', '.join(taken)}); continue it with "
            f"--resume {out_dir}, or give a new --out"
        )


def main(argv: list[str] | None = None) -> int:
    settings, out_dir, resume, no_report = parse_args(argv)
    try:
        trainer, train, validation = prepare(settings, out_dir, resume)
    except (CheckpointError, DatasetError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    trainer.fit(train, validation)
    if not no_report:
        from export.report import write_report

        write_report(trainer.out_dir, data_dir=trainer.settings.data_dir)
    return 0


def prepare(
    settings: TrainSettings, out_dir: Path | None, resume: Path | None
) -> tuple[Trainer, Split, Split]:
    """The trainer (fresh, resumed, or started from other weights) and its data splits."""
    if resume is not None:
        state_path = resume / "last" / "state.json"
        if not state_path.is_file():
            raise ValueError(f"{resume}: not a run to resume ({state_path} does not exist)")
        saved = json.loads(state_path.read_text())["settings"]
        # The schedule and data depend on the saved settings; only threads/compile may change.
        settings = TrainSettings(
            **{**saved, "threads": settings.threads, "compile": settings.compile}
        )
        out_dir = resume
    else:
        refuse_existing_run(out_dir)
    initial_weights = None
    if resume is None and settings.init_from is not None:
        initial_weights = resolve_checkpoint(settings.init_from)
        check_same_validation_split(settings, initial_weights)
        settings = replace(settings, init_from_sha256=file_sha256(initial_weights))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    train_full, _ = load_dataset(settings.dataset, settings.data_dir)
    train, validation = train_validation_split(train_full, settings.validation_size, settings.seed)
    if settings.train_limit:
        train = train.subset(torch.arange(min(settings.train_limit, len(train))))
    if len(train) < settings.batch_size:
        raise ValueError(
            f"batch size {settings.batch_size} exceeds the {len(train)} training images"
        )
    trainer = Trainer(settings, out_dir)
    if resume is not None:
        trainer.load_state(resume / "last")
        print(f"resumed {resume} at epoch {trainer.epoch}", flush=True)
    elif initial_weights is not None:
        trainer.load_initial_weights(initial_weights)
        if file_sha256(initial_weights) != settings.init_from_sha256:
            raise ValueError(f"{initial_weights} changed while it was read; is it still training?")
        print(f"starting from the weights of {initial_weights}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:  # a row left by a first epoch that stopped before saving its weights
        (out_dir / "metrics.csv").unlink(missing_ok=True)
    (out_dir / "settings.json").write_text(json.dumps(asdict(settings), indent=2))
    print(
        f"{settings.preset}: {trainer.model.num_parameters():,} parameters, "
        f"{len(train)} train / {len(validation)} validation images, device {trainer.device}",
        flush=True,
    )
    return trainer, train, validation


if __name__ == "__main__":
    raise SystemExit(main())
