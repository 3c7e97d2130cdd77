"""A user's folder of images to a served model, from the command line, with nothing edited by hand.

Drawn shapes (export/sample_folders.py) -> ``python -m export.train --dataset folder`` with architecture
flags -> ``python -m export.onnx RUN`` into a fresh repository, next to the shipped model ->
``python -m service`` -> held-out images (never seen in training) classified over HTTP.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest

from export.evaluate import evaluate_onnx
from export.sample_folders import SHAPES
from tests.support import REPO, Suite, running_server

EXPORT_SUITE = Suite(range(18400, 18450), ready_within_s=90.0)
PREDICT = "/models/shapes/predict"  # multi-model serving
CHANCE = 1 / len(SHAPES)


@pytest.mark.slow
def test_a_folder_of_shapes_is_trained_exported_and_served(
    shapes_run, shapes_folders, run_module, tmp_path
):
    repository = tmp_path / "models"
    exported = run_module(
        "export.onnx",
        *(str(shapes_run), "--name", "shapes", "--version", "1", "--repo", str(repository)),
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    shutil.copytree(REPO / "models" / "fashion-mnist-vit", repository / "fashion-mnist-vit")

    # The run's measured statistics and classes are what the exported model tells the service.
    settings = json.loads((shapes_run / "settings.json").read_text())
    props = {p.key: p.value for p in onnx.load(repository / "shapes/1/model.onnx").metadata_props}
    metadata = json.loads(props["vitserve"])
    assert metadata["labels"] == list(SHAPES) == settings["dataset_spec"]["labels"]
    assert metadata["preprocessing"]["mean"] == settings["dataset_spec"]["mean"]
    assert metadata["preprocessing"]["std"] == settings["dataset_spec"]["std"]
    assert metadata["preprocessing"]["polarity"] == "natural"
    shape = metadata["input"]
    assert (shape["channels"], shape["height"], shape["width"]) == (3, 32, 32)
    assert metadata["model_config"]["patch_embedding"] == "linear"
    assert metadata["test_accuracy"] > 0.7, metadata["test_accuracy"]
    # The ONNX file records the folder it was trained on: evaluating it finds the test images
    # there (or in --data-dir), and agrees with the export.
    assert metadata["data_dir"] == str(shapes_folders[0].resolve())
    results = evaluate_onnx(repository / "shapes/1/model.onnx")
    assert results["accuracy"] == metadata["test_accuracy"] and results["images"] == 36
    again = evaluate_onnx(repository / "shapes/1/model.onnx", data_dir=shapes_folders[0])
    assert again["accuracy"] == results["accuracy"]

    held_out = sorted(shapes_folders[1].rglob("*.*"))
    assert len(held_out) == 30
    answers = []
    with running_server(
        repository, tmp_path / "service.log", suite=EXPORT_SUITE, model_name="shapes"
    ) as server:
        for start in range(0, len(held_out), 5):
            batch = held_out[start : start + 5]
            files = [("files", (path.name, path.read_bytes())) for path in batch]
            # top_k is given: the service's default of 5 is refused for a model of 3 classes.
            response = httpx.post(
                server.url + PREDICT, files=files, data={"top_k": "3"}, timeout=60
            )
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"]["name"] == "shapes"
            answers += [prediction["label"] for prediction in body["predictions"]]
    truth = [path.parent.name for path in held_out]
    accuracy = float(np.mean([a == t for a, t in zip(answers, truth, strict=True)]))
    assert accuracy >= 2 * CHANCE, (accuracy, list(zip(truth, answers, strict=True)))


def test_the_shapes_are_drawn_at_mixed_sizes_and_formats(shapes_folders):
    from PIL import Image

    files = sorted(Path(shapes_folders[0]).rglob("*.*"))
    assert len(files) == 3 * 60
    sizes = {Image.open(path).size for path in files}
    formats = {Image.open(path).format for path in files}
    assert len(sizes) > 100 and formats == {"PNG", "JPEG", "BMP"}
    assert {Image.open(path).mode for path in files} == {"RGB"}
