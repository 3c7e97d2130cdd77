"""The seeds' tools on a trained folder run: TensorBoard logs (002), attention images for every layer
and head (000), and shapes after every module on a real image (000's print_shapes)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from export import report, summary
from export.checkpoint import load_checkpoint
from export.data import load_test_split, spec_from_metadata
from service.contract.attention_maps import overlay_png


def rows_of(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


# -- TensorBoard ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensorboard_events_hold_the_metrics_learning_rate_and_attention(shapes_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(shapes_run / "tensorboard"), size_guidance={"scalars": 0, "images": 0}
    )
    events.Reload()
    rows = rows_of(shapes_run)
    state = json.loads((shapes_run / "last" / "state.json").read_text())
    steps_per_epoch = state["step"] // state["epoch"]
    assert len(rows) == state["epoch"] >= 12
    for tag, column in [
        ("loss/train", "train_loss"),
        ("loss/validation", "val_loss"),
        ("accuracy/train", "train_accuracy"),
        ("accuracy/validation", "val_accuracy"),
    ]:
        scalars = events.Scalars(tag)
        assert [event.step for event in scalars] == [
            int(row["epoch"]) * steps_per_epoch for row in rows
        ]
        np.testing.assert_allclose(
            [event.value for event in scalars], [float(row[column]) for row in rows], rtol=1e-5
        )
    learning_rates = events.Scalars("train/learning_rate")
    assert [event.step for event in learning_rates] == list(range(1, state["step"] + 1))
    at_epoch_ends = [learning_rates[int(row["epoch"]) * steps_per_epoch - 1].value for row in rows]
    np.testing.assert_allclose(
        at_epoch_ends, [float(row["learning_rate"]) for row in rows], rtol=1e-5
    )
    assert len(events.Scalars("train/loss")) == state["step"]
    images = sorted(tag for tag in events.Tags()["images"])
    assert images == [f"attention/{n}" for n in range(4)]
    # A tile: a title row, then per layer (2) a label row and the maps; image, rollout, 2 heads.
    (tile,) = events.Images("attention/0")
    assert (tile.width, tile.height, tile.step) == (4 * 96, 14 + 2 * (96 + 14), state["step"])


# -- attention images ----------------------------------------------------------------------------
def reference_rollout(attention: np.ndarray) -> np.ndarray:
    """Abnar and Zuidema's rollout for one image, (layers, heads, T, T): written out again."""
    joint = np.eye(attention.shape[-1])
    for layer in attention:
        mixed = 0.5 * layer.mean(axis=0) + 0.5 * np.eye(attention.shape[-1])
        joint = mixed @ joint
    return joint


def scaled(values: np.ndarray) -> np.ndarray:
    return (values - values.min()) / (values.max() - values.min())


@pytest.mark.slow
def test_report_writes_every_layers_and_heads_attention_and_the_rollout(shapes_run, tmp_path):
    shapes_run = Path(shutil.copytree(shapes_run, tmp_path / "run"))  # shared: the report writes
    target = tmp_path / "attention"
    code = report.main([str(shapes_run), "--attention-dir", str(target), "--images", "3"])
    assert code == 0
    index = json.loads((target / "index.json").read_text())
    assert len(index) == 3 and {entry["true"] for entry in index} == {
        "circle",
        "square",
        "triangle",
    }
    model, metadata = load_checkpoint(shapes_run)
    spec = spec_from_metadata(metadata)
    test = load_test_split(spec)
    # The same batch the report ran, so that every float is the same.
    images = test.images[[entry["split_index"] for entry in index]]
    mean, std = (torch.tensor(values).view(1, 3, 1, 1) for values in (spec.mean, spec.std))
    with torch.inference_mode():
        _, maps = model.forward_with_attention((images.float() / 255 - mean) / std)
    heads = maps[:, 1, 0]  # layer 1, head 0
    for number, entry in enumerate(index):
        folder = target / entry["folder"]
        names = sorted(path.name for path in folder.iterdir())
        assert names == sorted(
            ["image.png", "tile.png", "rollout_layer1.png", "rollout_layer2.png"]
            + [f"layer{layer}_head{head}.png" for layer in (1, 2) for head in (1, 2)]
        )
        display = images[number].permute(1, 2, 0).numpy()
        assert np.array_equal(np.asarray(Image.open(folder / "image.png")), display)
        # Mean pooling: what the pooled token attends to is the mean of every query's row.
        head = heads[number].double().numpy()
        expected = scaled(head.mean(axis=0)).reshape(8, 8)
        assert (folder / "layer2_head1.png").read_bytes() == overlay_png(display, expected)
        rollout = scaled(reference_rollout(maps[number].double().numpy()).mean(axis=0))
        assert (folder / "rollout_layer2.png").read_bytes() == overlay_png(
            display, rollout.reshape(8, 8)
        )
        assert Image.open(folder / "layer1_head1.png").size == (224, 224)
    with pytest.raises(SystemExit) as exit_:
        report.main([str(shapes_run), "--attention-dir", str(target), "--images", "0"])
    assert exit_.value.code == 2


# -- shapes on a real forward pass ---------------------------------------------------------------
@pytest.mark.slow
def test_summary_prints_the_shape_after_every_module_of_an_image(
    shapes_run, shapes_folders, capsys
):
    image = next(iter(sorted((shapes_folders[1] / "triangle").iterdir())))
    assert summary.main([str(shapes_run), str(image)]) == 0
    out = capsys.readouterr().out
    model, _ = load_checkpoint(shapes_run)
    shown = {}
    for line in out.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0] in dict(model.named_modules()) | {"(model)": None}:
            shown[parts[0]] = (parts[1], parts[2])
    # Every module, with the shape an independent count gives: 8 x 8 patches of 4 x 4 x 3, dim 32.
    assert set(shown) == {name or "(model)" for name, _ in model.named_modules()}
    assert shown["patch_embedding.projection"] == ("Linear", "(1, 64, 32)")
    assert shown["patch_embedding"] == ("PatchEmbedding", "(1, 64, 32)")
    assert shown["blocks.1.attention.qkv"] == ("Linear", "(1, 64, 96)")
    assert shown["blocks.1.attention"] == ("Attention", "(1, 64, 32), (1, 2, 64, 64)")
    assert shown["blocks.0.mlp.fc1"] == ("Linear", "(1, 64, 64)")
    assert shown["norm"] == ("LayerNorm", "(1, 64, 32)")
    assert shown["head"] == ("Linear", "(1, 3)")
    assert shown["(model)"] == ("VisionTransformer", "(1, 3)")
    assert f"{image}: prepared as the service does" in out and "-> (1, 3, 32, 32)" in out
    assert "prediction: " in out and "triangle" in out.split("prediction: ")[1]


def test_summary_names_an_unreadable_image(shapes_run, tmp_path, capsys):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    assert summary.main([str(shapes_run), str(bad)]) == 2
    assert f"error: {bad}: " in capsys.readouterr().err


def test_summary_needs_a_preset_or_a_checkpoint(capsys):
    with pytest.raises(SystemExit) as exit_:
        summary.main([])
    assert exit_.value.code == 2
    assert "give either --preset NAME or a checkpoint" in capsys.readouterr().err


class Interrupted(Exception):
    pass


@pytest.mark.slow
def test_a_resumed_run_logs_every_epoch_once(tmp_path, tiny_preset, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from export import train

    run = tmp_path / "run"
    args = [
        *("--preset", tiny_preset, "--epochs", "2", "--batch-size", "64", "--train-limit", "128"),
        *("--validation-size", "64", "--warmup-epochs", "1", "--tensorboard", "--no-report"),
        *("--out", str(run)),
    ]
    save_state = train.Trainer.save_state

    def stop_before_saving_epoch_2(self):
        if self.epoch == 2:  # its metrics row and TensorBoard events are written by now
            raise Interrupted
        save_state(self)

    with monkeypatch.context() as patch:
        patch.setattr(train.Trainer, "save_state", stop_before_saving_epoch_2)
        with pytest.raises(Interrupted):
            train.main(args)
    assert train.main(["--resume", str(run)]) == 0
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [event.step for event in events.Scalars("loss/validation")] == [2, 4]
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3, 4]
    rows = rows_of(run)
    assert [event.value for event in events.Scalars("loss/validation")] == pytest.approx(
        [float(row["val_loss"]) for row in rows], rel=1e-5
    )
    assert [event.step for event in events.Images("attention/0")] == [4]
