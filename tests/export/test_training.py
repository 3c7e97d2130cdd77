"""Optimizer, schedule, a real training smoke run, and resuming."""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export import train
from export.checkpoint import file_sha256
from export.data import Split, get_dataset_spec
from export.model import VisionTransformer
from export.train import TrainSettings, configure_optimizer, learning_rate_at
from tests.export.runs import init_from_args, tiny_run_args


def read_rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_weight_decay_only_on_parameters_with_two_or_more_dims(tiny_config):
    model = VisionTransformer(tiny_config.replace(representation_size=8))
    optimizer = configure_optimizer(model, TrainSettings(weight_decay=0.05))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    grouped = {id(p) for p in decay["params"]} | {id(p) for p in no_decay["params"]}
    assert grouped == {id(p) for p in model.parameters()}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.head.bias) in no_decay_ids and id(model.norm.weight) in no_decay_ids
    assert id(model.blocks[0].attention.qkv.weight) not in no_decay_ids


def test_learning_rate_warms_up_linearly_then_follows_a_cosine():
    settings = TrainSettings(learning_rate=1e-3, min_learning_rate=1e-5)
    total, warmup = 1000, 100
    lr = [learning_rate_at(step, total, warmup, settings) for step in range(total + 1)]
    assert lr[0] == pytest.approx(1e-5) and lr[49] == pytest.approx(5e-4)
    assert lr[99] == pytest.approx(1e-3) and lr[100] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lr[:100]))
    assert all(a >= b for a, b in itertools.pairwise(lr[100:]))
    assert lr[550] == pytest.approx((1e-3 + 1e-5) / 2)
    assert lr[1000] == pytest.approx(1e-5)
    middle = 100 + 225  # a quarter of the way through the cosine
    assert lr[middle] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.slow
def test_training_on_real_fashion_mnist_lowers_the_validation_loss(tiny_run):
    rows = read_rows(tiny_run)
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3, 4, 5, 6]
    losses = [float(row["val_loss"]) for row in rows]
    # The head starts at zero, so the loss before any learning is ln(10) = 2.303.
    assert losses[0] < math.log(10) - 0.2, losses
    assert losses[-1] < losses[0] - 0.3, losses
    assert losses[-1] <= min(losses) + 0.02, losses
    assert float(rows[-1]["val_accuracy"]) > 0.6
    settings = json.loads((tiny_run / "settings.json").read_text())
    assert settings["train_limit"] == 2000 and settings["preset"] == "test-tiny"
    for name in (
        "model.safetensors",
        "last/model.safetensors",
        "last/optimizer.safetensors",
        "last/state.json",
    ):
        assert (tiny_run / name).is_file(), name
    state = json.loads((tiny_run / "last" / "state.json").read_text())
    assert state["epoch"] == 6 and state["step"] == 6 * 2000 // 50


class Interrupted(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("stopped", ["after saving epoch 1", "before saving epoch 2"])
def test_resume_continues_exactly_where_an_uninterrupted_run_goes(
    tmp_path, tiny_preset, monkeypatch, stopped
):
    args = [
        "--preset",
        tiny_preset,
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--train-limit",
        "256",
        "--validation-size",
        "128",
        "--warmup-epochs",
        "1",
        "--seed",
        "5",
        "--no-report",
    ]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert train.main([*args, "--out", str(straight)]) == 0

    save_state = train.Trainer.save_state

    def save_then_stop(self):
        # Epoch 2 has written its metrics row by the time it saves its state.
        if stopped == "before saving epoch 2" and self.epoch == 2:
            raise Interrupted
        save_state(self)
        if stopped == "after saving epoch 1" and self.epoch == 1:
            raise Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(train.Trainer, "save_state", save_then_stop)
        with pytest.raises(Interrupted):
            train.main([*args, "--out", str(interrupted)])
    assert json.loads((interrupted / "last" / "state.json").read_text())["epoch"] == 1
    torch.manual_seed(1234)  # whatever the global RNG holds now, resuming must restore it
    ignored = tmp_path / "ignored"
    assert train.main(["--out", str(ignored), "--resume", str(interrupted)]) == 0
    assert not ignored.exists()

    ends = [
        json.loads((run / "last" / "state.json").read_text()) for run in (straight, interrupted)
    ]
    assert ends[0]["step"] == ends[1]["step"] == 2 * (256 // 64)
    assert ends[0]["epoch"] == ends[1]["epoch"] == 2
    for name in ("last/model.safetensors", "last/optimizer.safetensors", "model.safetensors"):
        a, b = load_file(str(straight / name)), load_file(str(interrupted / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key} differs after resuming"
    rows = [read_rows(run) for run in (straight, interrupted)]
    assert [r["val_loss"] for r in rows[0]] == [r["val_loss"] for r in rows[1]]


@pytest.mark.parametrize("given", ["run directory", "checkpoint file"])
def test_init_from_starts_with_the_checkpoint_weights_and_a_fresh_optimizer(
    tiny_run, tiny_preset, tmp_path, given
):
    init_from = tiny_run if given == "run directory" else tiny_run / "model.safetensors"
    settings, out, resume, _ = train.parse_args(
        init_from_args(tiny_preset, init_from, tmp_path / "child")
    )
    trainer, _, _ = train.prepare(settings, out, resume)
    parent = load_file(str(tiny_run / "model.safetensors"))
    child = trainer.model.state_dict()
    assert parent.keys() == child.keys()
    assert all(torch.equal(parent[key], child[key]) for key in parent)
    assert trainer.epoch == trainer.step == 0 and not trainer.optimizer.state
    recorded = json.loads((out / "settings.json").read_text())
    assert recorded["init_from"] == str(init_from)
    assert recorded["init_from_sha256"] == file_sha256(tiny_run / "model.safetensors")


@pytest.mark.slow
def test_init_from_continues_from_the_trained_model(tiny_run, tiny_preset, tmp_path):
    child = tmp_path / "child"
    assert train.main(init_from_args(tiny_preset, tiny_run, child)) == 0
    parent_best = min(float(row["val_loss"]) for row in read_rows(tiny_run))
    [row] = read_rows(child)
    # From scratch, one small epoch at 1e-4 stays near ln(10) = 2.30; from the parent it starts there.
    assert float(row["val_loss"]) < parent_best + 0.05, (row, parent_best)
    assert (child / "model.safetensors").is_file() and (child / "last/state.json").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--seed", "1"), "seed=0.*seed=1.*validation split would differ"),
        (("--validation-size", "500"), "validation_size=1000.*validation_size=500"),
    ],
)
def test_init_from_refuses_a_parent_trained_on_this_runs_validation_images(
    tiny_run, tiny_preset, tmp_path, capsys, extra, message
):
    out = tmp_path / "child"
    assert train.main(init_from_args(tiny_preset, tiny_run, out, *extra)) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_init_from_refuses_a_checkpoint_of_another_architecture(tiny_run, tmp_path, capsys):
    args = init_from_args("mnist-tiny", tiny_run, tmp_path / "child")
    assert train.main(args) == 2
    error = capsys.readouterr().err
    assert "holds a different model" in error and "'mnist-tiny'" in error
    assert not (tmp_path / "child").exists()


def test_init_from_names_a_missing_checkpoint(tiny_preset, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert train.main(init_from_args(tiny_preset, missing, tmp_path / "child")) == 2
    assert f"{missing}: no such checkpoint file" in capsys.readouterr().err


def test_resume_names_a_missing_run(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert train.main(["--out", str(tmp_path / "x"), "--resume", str(missing)]) == 2
    assert f"{missing}: not a run to resume" in capsys.readouterr().err


@pytest.mark.parametrize("start_from_itself", [False, True])
def test_a_new_run_never_writes_into_a_run_that_exists(
    tiny_run, tiny_preset, tmp_path, capsys, start_from_itself
):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    args = (
        init_from_args(tiny_preset, run, run)
        if start_from_itself
        else tiny_run_args(tiny_preset, run)
    )
    assert train.main(args) == 2
    assert f"{run} already holds a run" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


def test_a_run_stopped_before_its_first_epoch_was_saved_is_started_over(tiny_preset, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "settings.json").write_text("{}")  # all that such a run leaves, and at most
    (out / "metrics.csv").write_text("epoch,val_loss\n1,2.3\n")  # the row of its first epoch
    settings, out, resume, _ = train.parse_args(tiny_run_args(tiny_preset, out))
    trainer, _, _ = train.prepare(settings, out, resume)
    assert trainer.epoch == 0
    assert json.loads((out / "settings.json").read_text())["preset"] == tiny_preset
    assert not (out / "metrics.csv").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume", "RUN", "--init-from", "RUN"], "--init-from starts a new one"),
        (["--preset", "mnist-tiny"], "--out RUN_DIR is required for a new run"),
    ],
)
def test_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_needs_no_out(tmp_path):
    _, out, resume, _ = train.parse_args(["--resume", str(tmp_path)])
    assert resume == tmp_path and out is None


# -- early stopping ------------------------------------------------------------------------------
def synthetic_trainer(tmp_path: Path, tiny_config, **changes) -> tuple[train.Trainer, Split, Split]:
    spec = get_dataset_spec("fashion-mnist")
    settings = TrainSettings(
        epochs=20,
        batch_size=16,
        warmup_epochs=0,
        augment=False,
        model_config=tiny_config.to_dict(),
        **changes,
    )
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (32, 1, 28, 28), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (32,), generator=generator)
    return (
        train.Trainer(settings, tmp_path, spec),
        Split(images[:16], labels[:16]),
        Split(images[16:], labels[16:]),
    )


@pytest.mark.parametrize(
    ("patience", "losses", "epochs_run", "best_epoch"),
    [
        # An improvement resets the count; two epochs in a row without one stop the run.
        (2, [1.0, 0.9, 0.95, 0.85, 0.9, 0.86, 0.7, 0.6], 6, 4),
        # Equal is not better.
        (1, [1.0, 1.0, 0.5], 2, 1),
        # Improving every epoch, it runs them all.
        (3, [round(1.0 - 0.04 * epoch, 2) for epoch in range(20)], 20, 20),
    ],
)
def test_early_stopping_stops_after_patience_epochs_without_improvement(
    tmp_path, tiny_config, monkeypatch, capsys, patience, losses, epochs_run, best_epoch
):
    trainer, train_split, validation = synthetic_trainer(tmp_path, tiny_config, patience=patience)
    scripted = iter(losses)

    def scripted_evaluation(*args, **kwargs):
        return next(scripted), 0.5, None

    monkeypatch.setattr("export.trainer.evaluate_split", scripted_evaluation)
    trainer.fit(train_split, validation)
    rows = read_rows(tmp_path)
    assert [int(row["epoch"]) for row in rows] == list(range(1, epochs_run + 1))
    assert [float(row["val_loss"]) for row in rows] == losses[:epochs_run]
    stopped = epochs_run < trainer.settings.epochs
    assert ("early stop" in capsys.readouterr().out) == stopped
    saved = json.loads((tmp_path / "last" / "state.json").read_text())
    assert saved["epoch"] == epochs_run
    assert saved["epochs_without_improvement"] == (patience if stopped else 0)
    from export.checkpoint import read_metadata

    assert read_metadata(tmp_path / "model.safetensors")["epoch"] == str(best_epoch)


@pytest.mark.parametrize(("keep", "kept_epoch"), [("best", 2), ("last", 20)])
def test_the_run_keeps_its_best_or_its_last_weights(
    tmp_path, tiny_config, monkeypatch, keep, kept_epoch
):
    from export.checkpoint import read_metadata

    trainer, train_split, validation = synthetic_trainer(
        tmp_path, tiny_config, patience=20, keep=keep
    )
    scripted = iter([1.0, 0.5, *(0.7 + 0.01 * epoch for epoch in range(18))])
    monkeypatch.setattr(
        "export.trainer.evaluate_split", lambda *args, **kwargs: (next(scripted), 0.5, None)
    )
    trainer.fit(train_split, validation)
    assert read_metadata(tmp_path / "model.safetensors")["epoch"] == str(kept_epoch)
