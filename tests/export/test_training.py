"""Optimizer, schedule, a real training smoke run, and resuming."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export import train
from export.model import VisionTransformer
from export.train import TrainSettings, configure_optimizer, learning_rate_at


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
def test_resume_continues_exactly_where_an_uninterrupted_run_goes(
    tmp_path, tiny_preset, monkeypatch
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
        save_state(self)
        if self.epoch == 1:
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
