"""Defaults chosen from a folder's images, the help that shows every default, distillation's loss,
and fine-tuning weights across datasets."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from export import folder_defaults as defaults
from export import train
from export.checkpoint import load_checkpoint
from export.config import ViTConfig
from export.finetune import adapt
from export.folder_defaults import FolderSurvey, choose, survey
from export.model import VisionTransformer
from export.teacher import distillation_loss
from tests.export.conftest import REPO


def images(root: Path, sizes: list[tuple[int, int]], mode: str = "L") -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, size in enumerate(sizes):
        paths.append(root / f"{number}.png")
        Image.new(mode, size).save(paths[-1])
    return paths


# -- the survey --------------------------------------------------------------------------------
def test_grey_only_when_every_image_is_grey_and_the_median_size(tmp_path):
    grey = images(tmp_path / "grey", [(28, 28), (30, 20), (28, 28), (100, 90), (28, 28)])
    found = survey(grey)
    assert (found.width, found.height, found.grey) == (28, 28, True)
    # One colour photo among grey ones: the model takes colour.
    colour = images(tmp_path / "colour", [(28, 28)], mode="RGB")
    assert not survey(grey + colour).grey
    # A file that is not an image is left for the reader to report.
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    assert survey([*grey, notes]) == FolderSurvey(6, 28, 28, True)


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [
        (28, 28, (28, 28, 4)),  # Fashion-MNIST: as it is, patch 4 (7 x 7 patches)
        (32, 32, (32, 32, 4)),
        (68, 70, (64, 64, 8)),  # mixed shapes: capped at 64, patch 8
        (640, 480, (48, 64, 8)),  # photos: the aspect ratio kept, at most 64 a side
        (29, 29, (28, 28, 4)),  # the nearest multiple of the patch
    ],
)
def test_image_and_patch_size_follow_the_usual_size(width, height, expected):
    chosen = choose(FolderSurvey(100, width, height, True), 90, {})
    assert (chosen["image_height"], chosen["image_width"], chosen["patch_size"]) == expected


def test_model_batch_and_length_follow_the_number_of_images():
    found = FolderSurvey(0, 28, 28, True)
    small, large = choose(found, 1800, {}), choose(found, 55_000, {})
    assert (small["dim"], small["depth"], small["batch_size"]) == (64, 4, 64)
    assert (large["dim"], large["depth"], large["batch_size"]) == (128, 6, 128)
    # Length in optimizer steps: a small dataset gets many epochs, a large one fewer.
    assert small["steps"] == defaults.EPOCHS_WORTH * (1800 // 64)
    assert large["steps"] == defaults.MAX_STEPS and large["epochs"] < 50
    tiny = choose(found, 100, {})
    assert tiny["batch_size"] == 16 and tiny["steps"] == defaults.MIN_STEPS
    assert (small["hflip"], small["erase"], small["patience"]) == (False, False, small["epochs"])
    assert small["keep"] == "last"


def test_a_small_folder_gets_a_teacher():
    found = FolderSurvey(0, 28, 28, True)
    below = defaults.TEACHER_BELOW
    assert choose(found, below - 1, {})["teacher"] == "auto"
    assert choose(found, below, {})["teacher"] == "none"
    # The threshold is recorded with the choice, and printed with it.
    chosen = choose(found, 1800, {})
    assert chosen["teacher_below"] == below
    line = defaults.describe(chosen)
    assert f"teacher auto (auto under {below:,} training images)" in line
    assert "teacher_below" not in line
    # A teacher the user gave (or refused) is kept.
    assert "teacher" not in choose(found, 1800, {"teacher": "none"})


def test_soft_distillation_and_no_distillation_token_unless_asked():
    def parsed(*args: str):
        settings, _, _, _ = train.parse_args([*args, "--out", "runs/x"])
        return settings.distillation, settings.model_config["distillation_token"]

    assert parsed("--teacher", "auto") == ("soft", False)
    assert parsed("--teacher", "auto", "--distillation", "hard", "--distillation-token") == (
        "hard",
        True,
    )


def test_what_the_user_gave_is_kept_and_shapes_the_rest():
    found = FolderSurvey(0, 28, 28, True)
    chosen = choose(found, 1800, {"batch_size": 32, "hflip": True, "image_height": 32})
    assert "batch_size" not in chosen and "hflip" not in chosen and "image_height" not in chosen
    assert chosen["steps"] == defaults.EPOCHS_WORTH * (1800 // 32)  # from the given batch
    assert chosen["patch_size"] == 4 and chosen["image_width"] == 28
    assert "steps" not in choose(found, 1800, {"epochs": 10})
    # A given patch size (a fine-tuned parent's) shapes the image size.
    assert choose(found, 1800, {"patch_size": 7})["image_height"] == 28
    assert choose(FolderSurvey(0, 60, 60, False), 500, {"patch_size": 7})["image_height"] == 63


# -- --help ----------------------------------------------------------------------------------
def help_text(capsys) -> str:
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    return capsys.readouterr().out


def test_help_shows_every_default_and_the_readme_example(capsys):
    text = help_text(capsys)
    options = re.findall(r"^  (--[a-z-]+)", text, flags=re.MULTILINE)
    assert {"--teacher", "--hflip", "--erase", "--steps", "--distillation"} <= set(options)
    flat = " ".join(text.split())
    assert "--lr LEARNING_RATE peak (default: 0.001)" in flat
    assert "images a step (default: chosen from the data for folder, else 128)" in flat
    # Every training option with a value says its default; the model flags say it in their group.
    for option in TRAINING_OPTIONS:
        (block,) = re.findall(rf"\n  {option}[ ,].*?(?=\n  -|\n\n)", text, flags=re.DOTALL)
        assert "default" in block.lower(), block
    assert "Default: the preset's, and for a folder without --preset, chosen from its" in flat
    # The example renders on one line, and is the README's.
    example = "python -m export.train --dataset folder --data-dir photos --out runs/photos"
    assert f"\n    {example}\n" in text
    assert f"`.venv/bin/{example}`" in (REPO / "README.md").read_text()


TRAINING_OPTIONS = [
    "--preset",
    "--dataset",
    "--epochs",
    "--steps",
    "--batch-size",
    "--lr",
    "--min-lr",
    "--weight-decay",
    "--warmup-epochs",
    "--label-smoothing",
    "--clip-grad-norm",
    "--patience",
    "--no-augment",
    "--hflip",
    "--erase",
    "--teacher",
    "--distillation",
    "--validation-size",
    "--seed",
    "--threads",
]


# -- distillation ----------------------------------------------------------------------------
def test_hard_distillation_is_half_labels_half_the_teachers_class():
    generator = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(8, 5, generator=generator), torch.randn(8, 5, generator=generator)
    labels = torch.randint(0, 5, (8,), generator=generator)
    expected = 0.5 * F.cross_entropy(logits, labels) + 0.5 * F.cross_entropy(
        logits, teacher.argmax(1)
    )
    assert torch.isclose(distillation_loss(logits, teacher, labels, "hard", 0.0), expected)
    # Soft: nothing to learn from a teacher that already agrees.
    agreeing = distillation_loss(logits, logits, labels, "soft", 0.0)
    assert torch.isclose(agreeing, 0.5 * F.cross_entropy(logits, labels), atol=1e-6)
    with pytest.raises(ValueError, match="distillation must be one of"):
        distillation_loss(logits, teacher, labels, "medium", 0.0)


def test_the_teacher_keeps_its_last_weights(tmp_path, monkeypatch):
    """Not those of its epoch of lowest validation loss (docs/training.md: the last scored better)."""
    from export import teacher as teacher_module
    from export.data import get_dataset_spec
    from export.dataset_spec import Split
    from export.teacher import load_teacher, train_teacher

    spec = get_dataset_spec("fashion-mnist")
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (48, 1, 28, 28), dtype=torch.uint8, generator=generator)
    split = Split(images, torch.arange(48) % 10)
    # The validation loss is lowest after the first epoch, then rises.
    losses = iter([0.1, 0.5, 0.9, 1.3])
    monkeypatch.setattr(teacher_module, "evaluate_teacher", lambda *_: (next(losses), 0.5))
    after_steps = []
    real_step = torch.optim.AdamW.step

    def step(optimizer, *args, **kwargs):
        result = real_step(optimizer, *args, **kwargs)
        weights = optimizer.param_groups[0]["params"][0]
        after_steps.append(weights.detach().clone())
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    path = tmp_path / "teacher.safetensors"
    model = train_teacher(split, split, spec, None, 9, 16, 0, path)  # 3 epochs of 3 steps
    saved = load_teacher(path, spec)
    first = next(iter(saved.state_dict().values()))
    assert len(after_steps) == 9 and torch.equal(first, after_steps[-1])
    assert not torch.equal(first, after_steps[2])  # the epoch of lowest validation loss
    assert torch.equal(next(iter(model.state_dict().values())), first)
    figures = teacher_module.teacher_metadata(path)["figures"]
    assert figures["steps"] == 9 and figures["cpu_seconds"] >= 0


# -- fine-tuning across datasets -----------------------------------------------------------
def test_weights_are_adapted_to_other_channels_grid_and_classes():
    torch.manual_seed(0)
    parent = VisionTransformer(ViTConfig(patch_size=7, dim=32, depth=2, heads=2, mlp_dim=64))
    with torch.no_grad():
        for parameter in parent.parameters():
            parameter.add_(torch.randn_like(parameter))
    config = parent.config.replace(in_channels=3, image_height=63, image_width=63, num_classes=3)
    child = VisionTransformer(config)
    done = adapt(parent, child, same_classes=False)
    assert len(done) == 3, done
    # A grey image shown in colour embeds as the parent embedded it.
    grey = torch.rand(2, 1, 63, 63)
    embedded = child.patch_embedding.projection(grey.expand(-1, 3, -1, -1))
    parent_embedded = parent.patch_embedding.projection(grey)
    assert torch.allclose(embedded, parent_embedded, atol=1e-5)
    assert child.position_embedding.shape[1] == 81  # a 9 x 9 grid from a 4 x 4 one
    assert not child.head.weight.any() and child.head.weight.shape == (3, 32)
    for name, value in child.blocks.state_dict().items():
        assert torch.equal(value, parent.blocks.state_dict()[name]), name
    # The same classes keep the head.
    grey_child = VisionTransformer(config.replace(in_channels=1, num_classes=10))
    adapt(parent, grey_child, same_classes=True)
    assert torch.equal(grey_child.head.weight, parent.head.weight)


@pytest.mark.slow
def test_init_from_a_run_on_other_data_fine_tunes_it(tiny_run, shapes_folders, tmp_path, capsys):
    """Grey Fashion-MNIST (10 classes) -> a folder of colour shapes (3 classes); the card names the
    parent."""
    from export.lineage import training_stages
    from export.model_card import lineage_lines

    out = tmp_path / "shapes"
    folder = ("--dataset", "folder", "--data-dir", str(shapes_folders[0]), "--out", str(out))
    args = (*folder, "--init-from", str(tiny_run), "--steps", "4", "--teacher", "none")
    assert train.main([*args, "--threads", "1", "--no-report"]) == 0
    printed = capsys.readouterr().out
    assert "patch embedding 1 -> 3 channel(s)" in printed
    assert "head initialised afresh for 3 classes" in printed
    config = ViTConfig.from_dict(json.loads((out / "settings.json").read_text())["model_config"])
    parent = load_checkpoint(tiny_run)[0].config
    assert (config.dim, config.depth, config.patch_size) == (parent.dim, parent.depth, 7)
    assert (config.in_channels, config.num_classes, config.image_height % 7) == (3, 3, 0)
    (line,) = lineage_lines(training_stages(out))
    assert line.startswith(f"- Fine-tuned: `{out}` started from `{tiny_run}`")
    # The model is the parent's: a flag that would change it is refused.
    data = ("--dataset", "folder", "--data-dir", str(shapes_folders[0]))
    changed = (*data, "--out", str(tmp_path / "other"), "--init-from", str(tiny_run), "--dim", "48")
    assert train.main([*changed, "--steps", "4"]) == 2
    assert "keeps the parent's model; these differ from it: dim 48" in capsys.readouterr().err


def test_the_model_card_command_leaves_out_what_the_images_chose():
    from export.model_card import train_command

    args = ["--dataset", "folder", "--data-dir", "photos", "--dim", "48", "--hflip", "--out", "r"]
    settings, _, _, _ = train.parse_args(args)
    given = dataclasses.asdict(settings)
    chosen = choose(FolderSurvey(0, 28, 28, True), 1800, {**given, **settings.model_flags})
    recorded = {**given, **{k: v for k, v in chosen.items() if k in given}}
    recorded["chosen_from_data"] = chosen
    recorded["model_config"] = ViTConfig(dim=48, heads=4).to_dict()
    command = train_command(recorded, out="runs/again")
    assert command == (
        "python -m export.train --dataset folder --data-dir photos --dim 48 --hflip --out runs/again"
    )


@pytest.mark.slow
def test_a_teacher_is_trained_first_then_reused_and_its_file_checked(
    shapes_folders, tiny_run, tmp_path, capsys, monkeypatch
):
    from export import trainer as trainer_module
    from export.lineage import training_stages
    from export.model_card import lineage_lines

    data = ("--dataset", "folder", "--data-dir", str(shapes_folders[0]), "--threads", "1")
    first = tmp_path / "first"
    terms = []
    real = trainer_module.distillation_loss

    def spy(logits, teacher_logits, labels, kind, smoothing, distillation_logits=None):
        terms.append((kind, teacher_logits.shape, distillation_logits is not None))
        return real(logits, teacher_logits, labels, kind, smoothing, distillation_logits)

    monkeypatch.setattr(trainer_module, "distillation_loss", spy)
    args = [*data, "--steps", "6", "--no-report", "--teacher", "auto", "--out", str(first)]
    assert train.main(args) == 0
    assert "training a CNN teacher for 3 steps" in capsys.readouterr().out
    teacher = first / "teacher.safetensors"
    assert teacher.is_file() and terms == [("soft", (16, 3), False)] * 6  # every step distils
    (line,) = lineage_lines(training_stages(first))
    assert line.startswith(
        "- Distilled (soft distillation, DeiT-style) from a small CNN teacher (width 16, 3 steps in "
    )
    assert f" minutes), trained first on the same split: `{teacher}`" in line
    # Reused by path, hard, through a distillation token: no new teacher is trained.
    second = tmp_path / "second"
    args = [*data, "--steps", "2", "--no-report", "--teacher", str(teacher), "--out", str(second)]
    assert train.main([*args, "--distillation", "hard", "--distillation-token"]) == 0
    assert "training a CNN teacher" not in capsys.readouterr().out
    assert not (second / "teacher.safetensors").exists() and terms[-1] == ("hard", (16, 3), True)
    assert load_checkpoint(second)[0].config.distillation_token
    (line,) = lineage_lines(training_stages(second))
    assert line.startswith(
        "- Distilled (hard distillation, DeiT-style through a distillation token (the served "
        "logits are the mean of the class head's and the distillation head's)) from a small CNN"
    )
    assert f"given: `{teacher}`" in line
    # A teacher of other classes, or a file that is not a teacher, is refused.
    fashion = ("--dataset", "fashion-mnist", "--train-limit", "100", "--validation-size", "50")
    fashion = (*fashion, "--batch-size", "10")
    other = [*fashion, "--teacher", str(teacher), "--out", str(tmp_path / "x"), "--no-report"]
    assert train.main(other) == 2
    assert "takes 3-channel images of the classes circle, square, triangle" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x").exists()  # refused before anything is written
    wrong = [*data, "--teacher", str(tiny_run / "model.safetensors"), "--out", str(tmp_path / "y")]
    assert train.main(wrong) == 2
    assert "not a teacher written by --teacher auto" in capsys.readouterr().err
