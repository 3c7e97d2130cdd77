"""A folder of real images trained with the defaults alone, then exported, quantized, evaluated and
served, as a new user would: real Fashion-MNIST images written out as PNG files
(``export.sample_folders``), ``python -m export.train --dataset folder --data-dir D --out R`` and a
small budget (``--steps``), nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from export import quantize
from export.data import FASHION_MNIST_LABELS
from export.evaluate import evaluate_onnx
from export.folder_defaults import TEACHER_BELOW
from export.onnx import export_model
from export.sample_folders import write_fashion_mnist
from tests.export.conftest import FASHION_DIR
from tests.support import Suite, running_server

# Export end-to-end ports (docs/ARCHITECTURE.md), apart from test_folder_end_to_end's.
SUITE = Suite(range(18425, 18450), ready_within_s=90.0)
TRAIN_PER_CLASS, TEST_PER_CLASS, STEPS = 40, 10, 150
pytestmark = pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="needs dataset-fashion-mnist")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """400 training and 100 test PNGs, and a stray text file among the training images."""
    root = write_fashion_mnist(
        tmp_path_factory.mktemp("fashion") / "photos",
        TRAIN_PER_CLASS,
        test_per_class=TEST_PER_CLASS,
    )
    (root / "train" / "Bag" / "notes.txt").write_text("bought in 2019")
    return root


@pytest.fixture(scope="module")
def defaults_run(folder, tmp_path_factory, run_module):
    out = tmp_path_factory.mktemp("runs") / "photos"
    args = ("--dataset", "folder", "--data-dir", str(folder), "--out", str(out))
    completed = run_module("export.train", *args, "--steps", str(STEPS), timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return out, completed


@pytest.fixture(scope="module")
def exported(defaults_run, tmp_path_factory, run_module) -> Path:
    """The run exported as a user would (``python -m export.onnx``, its test accuracy measured): a
    repository holding ``photos`` version 1. The tests below only read it."""
    out, _ = defaults_run
    repository = tmp_path_factory.mktemp("exported") / "models"
    completed = run_module(
        "export.onnx", str(out), "--name", "photos", "--version", "1", "--repo", str(repository)
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return repository


@pytest.mark.slow
def test_the_defaults_are_chosen_from_the_images_printed_once_and_recorded(defaults_run, folder):
    out, completed = defaults_run
    settings = json.loads((out / "settings.json").read_text())
    chosen = settings["chosen_from_data"]
    # 28 x 28 grey PNGs: that size and one channel, patch 4; 360 training images: a small model
    # and a small batch; no flips or erasing for a folder; a CNN teacher, as for any folder of
    # under TEACHER_BELOW images.
    assert (chosen["image_height"], chosen["image_width"], chosen["in_channels"]) == (28, 28, 1)
    assert (chosen["patch_size"], chosen["dim"], chosen["depth"]) == (4, 64, 4)
    assert chosen["batch_size"] == 16 and settings["teacher"] == chosen["teacher"] == "auto"
    assert chosen["teacher_below"] == TEACHER_BELOW and settings["distillation"] == "soft"
    assert (chosen["hflip"], chosen["erase"], chosen["keep"]) == (False, False, "last")
    assert "steps" not in chosen and settings["steps"] == STEPS  # the flag overrides
    config = settings["model_config"]
    assert (config["in_channels"], config["image_height"], config["patch_size"]) == (1, 28, 4)
    assert config["distillation_token"] is False
    lines = [
        line for line in completed.stdout.splitlines() if "defaults chosen from the data" in line
    ]
    assert len(lines) == 1 and "image_height 28" in lines[0] and "batch_size 16" in lines[0]
    assert f"teacher auto (auto under {TEACHER_BELOW:,} training images)" in lines[0]
    assert (out / "teacher.safetensors").is_file()
    # The stray file: skipped with one warning that names it, no Python object in it.
    warnings = [line for line in completed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, completed.stderr[-2000:]
    assert "skipped 1 of 401" in warnings[0] and str(folder / "train/Bag/notes.txt") in warnings[0]
    assert "BytesIO" not in completed.stderr


@pytest.mark.slow
def test_the_model_is_exported_evaluated_from_the_recorded_folder_and_served(
    exported, folder, run_module, tmp_path
):
    repository = exported
    # No --data-dir: the test images come from the folder the run recorded.
    evaluated = run_module("export.evaluate", str(repository / "photos"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = evaluate_onnx(repository / "photos/1/model.onnx")
    assert (
        results["images"] == 10 * TEST_PER_CLASS and f"{results['correct']}/100" in evaluated.stdout
    )
    assert results["accuracy"] >= 0.3, results["accuracy"]  # 150 steps; chance is 0.1

    test_files = sorted((folder / "test").rglob("*.png"))
    answers = []
    log = tmp_path / "service.log"
    with running_server(repository, log, suite=SUITE, model_name="photos") as server:
        for start in range(0, len(test_files), 5):
            files = [("files", (p.name, p.read_bytes())) for p in test_files[start : start + 5]]
            response = httpx.post(server.url + "/models/photos/predict", files=files, timeout=60)
            assert response.status_code == 200, response.text
            answers += [prediction["label"] for prediction in response.json()["predictions"]]
        # The distilled model's attention maps, over its 7 x 7 patches.
        attention = httpx.post(
            server.url + "/models/photos/attention",
            files={"file": (test_files[0].name, test_files[0].read_bytes())},
            timeout=60,
        )
        assert attention.status_code == 200, attention.text
        body = attention.json()
        assert body["grid"] == [7, 7] and np.array(body["map"]).shape == (7, 7)
        assert body["prediction"]["label"] == answers[0]
    truth = [path.parent.name for path in test_files]
    served = float(np.mean([a == t for a, t in zip(answers, truth, strict=True)]))
    # The service reads the files as training did: the same predictions as the evaluation.
    assert served == results["accuracy"]
    assert set(answers) <= {label.replace("/", "-") for label in FASHION_MNIST_LABELS}


@pytest.mark.slow
def test_int8_export_of_a_folder_run_is_calibrated_on_its_own_training_images(
    defaults_run, tmp_path, monkeypatch
):
    out, _ = defaults_run
    settings = json.loads((out / "settings.json").read_text())
    seen = []
    choose = quantize.calibration_images

    def spy(images: torch.Tensor, count: int, seed: int = 0) -> torch.Tensor:
        seen.append(images)
        return choose(images, count, seed)

    monkeypatch.setattr(quantize, "calibration_images", spy)
    # A 150-step model on 100 test images: one image is a point, more than the drop allowed.
    monkeypatch.setattr(quantize, "MAX_ACCURACY_DROP", 1.0)
    int8 = quantize.Quantization("static-qdq", calibration_count=64)
    result = export_model(out, "photos-int8", 1, tmp_path, quantization=int8)
    assert result["quantization"] == "static-qdq" and result["calibration_images"] == 64
    # The run's training split: its 400 images less the validation tenth.
    (images,) = seen
    assert len(images) == 400 - 40 and settings["validation_size"] == 0.1
    metadata = evaluate_onnx(tmp_path / "photos-int8/1/model.onnx")
    assert metadata["precision"] == "int8" and metadata["dataset"] == "folder"


@pytest.mark.slow
def test_a_moved_folder_is_named_and_data_dir_overrides(exported, folder, run_module, tmp_path):
    repository = exported  # one export serves both tests: each costs tens of seconds here
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    original = folder.rename(folder.with_name("gone"))
    try:
        missing = run_module("export.evaluate", str(repository / "photos"))
        assert missing.returncode == 2 and f"trained on the folder {folder}" in missing.stderr
        found = run_module("export.evaluate", str(repository / "photos"), "--data-dir", str(moved))
        assert found.returncode == 0, found.stderr[-2000:]
    finally:
        original.rename(folder)
