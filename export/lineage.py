"""A run's training history: the run and every run it was started from (``--init-from``), in order.

The model card (export/model_card.py) tells each stage's data, length and result from these, and
refuses a lineage whose parent checkpoint has changed since the child started from it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from export.checkpoint import CheckpointError, file_sha256
from export.finetune import parent_weights
from export.importers import is_imported

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stage:
    """One training run; a run started ``--init-from`` another has that run as its earlier stage."""

    run_dir: Path
    settings: dict
    rows: list[dict]
    state: dict | None

    @property
    def seconds(self) -> float:
        return sum(float(row["seconds"]) for row in self.rows)

    @property
    def best(self) -> dict | None:
        """The row of the epoch with the lowest validation loss: the run's kept checkpoint."""
        return min(self.rows, key=lambda row: float(row["val_loss"])) if self.rows else None

    @property
    def finished(self) -> bool:
        state = self.state or {}
        return state.get("epoch", 0) >= self.settings.get("epochs", 0) or state.get(
            "epochs_without_improvement", 0
        ) >= self.settings.get("patience", 10**9)


def read_stage(run_dir: Path) -> Stage:
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    state_path = run_dir / "last" / "state.json"
    return Stage(
        run_dir=run_dir,
        settings=json.loads((run_dir / "settings.json").read_text()),
        rows=rows,
        state=json.loads(state_path.read_text()) if state_path.is_file() else None,
    )


def locate_parent(init_from: str) -> Path:
    """The checkpoint a run started from. The path was recorded as given on the command line, which
    is relative to where training ran: the current directory, or else the repository root."""
    path = Path(init_from)
    try:
        return parent_weights(path)
    except CheckpointError:
        if path.is_absolute() or not (REPO / path).exists():
            raise
        return parent_weights(REPO / path)


def training_stages(run_dir: Path) -> list[Stage]:
    """The run and, first, every run it started from, each checked to hold the weights it gave. A
    checkpoint imported from another library ends the lineage: it is no run of ours."""
    stages = [read_stage(run_dir)]
    while (init_from := stages[0].settings.get("init_from")) is not None:
        checkpoint = locate_parent(init_from)
        recorded = stages[0].settings.get("init_from_sha256")
        if file_sha256(checkpoint) != recorded:
            raise ValueError(
                f"{stages[0].run_dir} started from {checkpoint} with sha256 {recorded}, and that "
                "file has changed since: the card could not say how the model was trained"
            )
        if is_imported(checkpoint.parent):
            break
        if len(stages) > 32:
            raise ValueError(f"{run_dir}: --init-from runs form a cycle")
        stages.insert(0, read_stage(checkpoint.parent))
    return stages
