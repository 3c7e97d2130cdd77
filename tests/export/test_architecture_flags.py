"""Every ViTConfig field from the command line: preset, --config FILE.json, flags, and --resume."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from export import train
from export.config import ViTConfig, get_preset
from export.model_card import train_command
from export.model_flags import ARCHITECTURE_FLAGS, IMAGE_FLAGS

OUT = ["--out", "runs/x"]


def resolved(*args: str) -> ViTConfig:
    settings, _, _, _ = train.parse_args([*args, *OUT])
    return ViTConfig.from_dict(settings.model_config)


def usage_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        train.parse_args([*args, *OUT])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("python -m export.train: error: ")
    return lines[-1].removeprefix("python -m export.train: error: ")


def test_every_config_field_has_a_flag_but_the_class_count():
    fields = {field.name for field in dataclasses.fields(ViTConfig)}
    assert fields - {"num_classes"} == set(ARCHITECTURE_FLAGS) | set(IMAGE_FLAGS)


def test_without_flags_the_preset_fitted_to_the_dataset():
    assert resolved("--preset", "mnist-tiny") == get_preset("mnist-tiny")
    # cifar10-small's 32 x 32 x 3 become Fashion-MNIST's 28 x 28 x 1; patch 4 divides both.
    expected = get_preset("cifar10-small").replace(image_height=28, image_width=28, in_channels=1)
    assert resolved("--preset", "cifar10-small") == expected


def test_flags_override_every_field():
    config = resolved(
        *("--preset", "mnist-tiny", "--patch-size", "7", "--dim", "48", "--depth", "3"),
        *("--heads", "3", "--mlp-dim", "100", "--pooling", "mean"),
        *("--position-embedding", "sinusoidal", "--patch-embedding", "linear"),
        *("--representation-size", "none", "--dropout", "0.1", "--attention-dropout", "0.05"),
        *("--no-qkv-bias", "--layer-norm-eps", "1e-5", "--distillation-token"),
    )
    assert config == ViTConfig(
        image_height=28,
        image_width=28,
        in_channels=1,
        patch_size=7,
        num_classes=10,
        dim=48,
        depth=3,
        heads=3,
        mlp_dim=100,
        pooling="mean",
        position_embedding="sinusoidal",
        patch_embedding="linear",
        representation_size=None,
        distillation_token=True,
        dropout=0.1,
        attention_dropout=0.05,
        qkv_bias=False,
        layer_norm_eps=1e-5,
    )


def given(*args: str) -> dict:
    settings, _, _, _ = train.parse_args([*args, *OUT])
    assert settings.model_config is None  # chosen once the images are read
    return settings.model_flags


def test_a_folder_dataset_records_the_image_size_and_channels_it_was_given(tmp_path):
    folder = ("--dataset", "folder", "--data-dir", str(tmp_path))
    assert given(*folder, "--image-size", "48", "--channels", "3", "--patch-size", "8") == {
        "image_height": 48,
        "image_width": 48,
        "in_channels": 3,
        "patch_size": 8,
    }
    assert given(*folder, "--image-height", "24", "--image-width", "40") == {
        "image_height": 24,
        "image_width": 40,
    }
    assert given(*folder) == {}  # everything is chosen from the data
    # A preset names a model, not an image size.
    preset = given(*folder, "--preset", "fashion-small")
    assert preset["dim"] == 96 and "image_height" not in preset and "in_channels" not in preset


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"dim": 40, "heads": 4, "depth": 5, "num_classes": 99}))
    config = resolved("--preset", "fashion-small", "--config", str(path), "--heads", "5")
    preset = get_preset("fashion-small")
    assert (config.dim, config.heads, config.depth) == (40, 5, 5)
    assert config.mlp_dim == preset.mlp_dim and config.patch_size == preset.patch_size
    assert config.num_classes == 10  # always the dataset's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dim", "30", "--heads", "4"), "dim 30 is not divisible by heads 4"),
        (("--patch-size", "5"), "patch_size 5 does not divide image_height 28"),
        (
            ("--image-size", "32"),
            "--image-height 32: fashion-mnist images are 28x28 with 1 channel",
        ),
        (("--channels", "3"), "--channels 3: fashion-mnist images are 28x28"),
        (("--depth", "0"), "depth must be at least 1, got 0"),
        (("--dropout", "1.5"), r"dropout must be in \[0, 1\), got 1.5"),
        (
            ("--position-embedding", "sinusoidal", "--dim", "27", "--heads", "3"),
            "sinusoidal position embedding needs an even dim, got 27",
        ),
        (
            ("--dataset", "folder", "--data-dir", "d", "--image-size", "30", "--patch-size", "4"),
            "patch_size 4 does not divide image_height 30",
        ),
        (("--dataset", "folder"), "--dataset folder needs --data-dir DIR"),
        (
            ("--image-size", "28", "--image-width", "28"),
            "--image-size sets both sides; give it or --image-height/--image-width",
        ),
        (("--validation-size", "0"), "argument --validation-size: expected a count"),
    ],
)
def test_invalid_combinations_are_refused_in_one_line(capsys, args, message):
    assert re.search(message, usage_error(capsys, *args))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object of ViTConfig fields"),
        ('{"dim": 64, "colour": "red"}', "unknown ViTConfig fields: colour"),
        ('{"dim": "64"}', "dim must be an integer, got '64'"),
    ],
)
def test_a_bad_config_file_is_refused_in_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "model.json"
    path.write_text(content)
    assert message in usage_error(capsys, "--config", str(path))
    assert "cannot read it" in usage_error(capsys, "--config", str(tmp_path / "missing.json"))


def test_the_model_card_command_reproduces_the_model():
    args = [
        *("--preset", "mnist-tiny", "--dim", "48", "--heads", "3", "--no-qkv-bias"),
        *("--representation-size", "none", "--patch-embedding", "linear"),
    ]
    settings, _, _, _ = train.parse_args([*args, *OUT])
    command = train_command(dataclasses.asdict(settings), out="runs/again")
    again, _, _, _ = train.parse_args(command.split()[3:])
    assert again.model_config == settings.model_config
    assert "--dim 48" in command and "--no-qkv-bias" in command
    assert "--representation-size none" in command and "--depth" not in command


def test_resume_keeps_the_recorded_model(tmp_path, tiny_preset):
    run = tmp_path / "run"
    args = [
        *("--preset", tiny_preset, "--dim", "24", "--heads", "3", "--depth", "1"),
        *("--patch-embedding", "linear", "--pooling", "mean", "--epochs", "1"),
        *("--batch-size", "32", "--train-limit", "64", "--validation-size", "64", "--no-report"),
        *("--out", str(run)),
    ]
    assert train.main(args) == 0
    recorded = json.loads((run / "settings.json").read_text())["model_config"]
    assert (recorded["dim"], recorded["heads"], recorded["depth"]) == (24, 3, 1)
    assert recorded["patch_embedding"] == "linear"
    # Flags given again with --resume (as export.pipeline does) do not change the model.
    settings, out, resume, _ = train.parse_args(
        ["--preset", tiny_preset, "--dim", "64", "--heads", "4", "--resume", str(run)]
    )
    trainer, _, _ = train.prepare(settings, out, resume)
    assert trainer.model.config == ViTConfig.from_dict(recorded)
    assert json.loads((run / "settings.json").read_text())["model_config"] == recorded
    state = json.loads((run / "last" / "state.json").read_text())
    assert state["settings"]["model_config"] == recorded


def test_the_train_your_own_images_command_is_valid():
    """The README's "train on your own images" command parses, leaving the model to the data."""
    from tests.export.conftest import REPO

    text = (REPO / "README.md").read_text()
    (command,) = re.findall(r"`\.venv/bin/python -m export\.train (--dataset folder[^`]+)`", text)
    settings, out, _, _ = train.parse_args(command.split())
    assert (settings.dataset, settings.data_dir, str(out)) == ("folder", "photos", "runs/photos")
    assert settings.model_flags == {} and settings.batch_size is None and settings.teacher is None
