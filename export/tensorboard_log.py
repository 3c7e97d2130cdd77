"""TensorBoard logs of a training run (``--tensorboard``): ``tensorboard --logdir RUN_DIR/tensorboard``.

Scalars: ``train/loss`` and ``train/learning_rate`` every step; ``loss/train``, ``loss/validation``,
``accuracy/train``, ``accuracy/validation`` every epoch (x axis: the optimizer step, so epochs of a
resumed run line up). At the end, ``attention/<n>``: per validation image, a tile of every layer's
heads and the rollout (export/attention_images.py). The ``tensorboard`` package is needed only here.
"""

from __future__ import annotations

from pathlib import Path

from export.data import DatasetSpec, Split
from export.model import VisionTransformer

ATTENTION_IMAGES = 4


class TensorBoardLog:
    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch imports the tensorboard package lazily, here
            raise RuntimeError(
                "--tensorboard needs the tensorboard package: pip install -r requirements/export.txt"
            ) from error
        # Events at ``purge_step`` and later, from a run that stopped, are hidden from TensorBoard.
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def step(self, step: int, loss: float, learning_rate: float) -> None:
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/learning_rate", learning_rate, step)

    def epoch(self, step: int, row: dict) -> None:
        for metric in ("loss", "accuracy"):
            self.writer.add_scalar(f"{metric}/train", row[f"train_{metric}"], step)
            self.writer.add_scalar(f"{metric}/validation", row[f"val_{metric}"], step)
        self.writer.flush()

    def attention(
        self, step: int, model: VisionTransformer, split: Split, spec: DatasetSpec
    ) -> None:
        from export.attention_images import attention_pictures, pick_indices

        indices = pick_indices(split.labels, min(ATTENTION_IMAGES, len(split)))
        for number, picture in enumerate(attention_pictures(model, split, indices, spec)):
            self.writer.add_image(f"attention/{number}", picture["tile"], step, dataformats="HWC")
            self.writer.add_text(
                f"attention/{number}",
                f"validation image {picture['index']}: true {picture['true']}, "
                f"predicted {picture['predicted']}",
                step,
            )

    def close(self) -> None:
        self.writer.close()
