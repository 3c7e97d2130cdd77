"""The run report, the evaluate command (checkpoint and ONNX) and the one-command pipeline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import numpy as np
import onnx
import pytest

from export import evaluate, pipeline, report
from export.checkpoint import load_checkpoint
from export.data import get_dataset_spec, load_dataset, normalize
from export.evaluate import (
    EvaluationError,
    classification_metrics,
    dataset_logits,
    evaluate_onnx,
    onnx_runner,
)
from export.train import evaluate_split
from service.contract.model_repository import Preprocessing
from service.contract.preprocessing import normalise
from tests.support import made_once

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reported(tiny_run, tmp_path_factory) -> tuple[Path, dict]:
    """A copy of tiny_run with its report written, and what ``write_report`` returned (kept apart
    from the results.json it wrote); made once for every xdist worker: the tests only read it."""

    def make(directory: Path) -> None:
        run = Path(shutil.copytree(tiny_run, directory / "run"))
        (directory / "returned.json").write_text(json.dumps(report.write_report(run)))

    directory = made_once(tmp_path_factory, "reported", make)
    return directory / "run", json.loads((directory / "returned.json").read_text())


@pytest.fixture(scope="module")
def piped(tiny_run, tmp_path_factory) -> tuple[Path, Path, int]:
    """The pipeline on a finished run: it resumes (nothing left to train), reports, exports, evaluates;
    made once for every xdist worker: the tests only read what it wrote."""

    def make(base: Path) -> None:
        run, repo = base / "run", base / "models"
        shutil.copytree(tiny_run, run)
        code = pipeline.main(
            [
                "--preset",
                "test-tiny",
                "--dataset",
                "fashion-mnist",
                "--out",
                str(run),
                "--name",
                "tiny",
                "--version",
                "2",
                "--repo",
                str(repo),
            ]
        )
        (base / "code").write_text(str(code))

    base = made_once(tmp_path_factory, "piped", make)
    return base / "run", base / "models", int((base / "code").read_text())


def onnx_metadata(path: Path) -> dict:
    return json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["vitserve"])


# -- metrics -----------------------------------------------------------------------------------
def test_classification_metrics_by_hand():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [5.0, 0.0, 0.0]])
    labels = np.array([0, 1, 1, 2])
    metrics = classification_metrics(logits, labels, ["a", "b", "c"])
    assert metrics["confusion_matrix"] == [[1, 0, 0], [0, 1, 1], [1, 0, 0]]
    assert metrics["accuracy"] == 0.5 and metrics["correct"] == 2 and metrics["images"] == 4
    assert metrics["per_class_accuracy"] == {"a": 1.0, "b": 0.5, "c": 0.0}
    expected = -np.mean(
        [
            np.log(np.exp(row[label]) / np.exp(row).sum())
            for row, label in zip(logits, labels, strict=True)
        ]
    )
    assert metrics["loss"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(EvaluationError, match=r"expected logits of shape \(4, 2\)"):
        classification_metrics(logits, labels, ["a", "b"])


# -- the one normaliser and the one loop ---------------------------------------------------------
def preprocessing(mean, std, scale=1 / 255) -> Preprocessing:
    color = "grayscale" if len(mean) == 1 else "rgb"
    return Preprocessing(
        color=color,
        resize="fit-pad",
        pad_value=0,
        polarity="natural",
        scale=scale,
        mean=mean,
        std=std,
    )


def test_normalise_by_hand_per_channel_in_a_batch():
    pixels = np.zeros((2, 3, 1, 2), dtype=np.uint8)
    pixels[0, :, 0, 0] = [255, 51, 0]
    pixels[1, :, 0, 1] = [0, 102, 255]
    out = normalise(pixels, preprocessing([0.5, 0.2, 0.0], [0.25, 0.1, 2.0]))
    assert out.dtype == np.float32 and out.shape == (2, 3, 1, 2)
    np.testing.assert_allclose(out[0, :, 0, 0], [2.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(out[1, :, 0, 1], [-2.0, 2.0, 0.5], atol=1e-6)
    np.testing.assert_allclose(out[0, :, 0, 1], [-2.0, -2.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(
        normalise(pixels[0], preprocessing([0.0] * 3, [1.0] * 3, 1.0)), pixels[0]
    )


def test_normalise_agrees_with_the_training_normaliser():
    spec = get_dataset_spec("fashion-mnist")
    _, test = load_dataset("fashion-mnist")
    images = test.images[:64]
    expected = normalize(images, spec).numpy()
    got = normalise(images.numpy(), preprocessing(list(spec.mean), list(spec.std)))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_normalise_refuses_pixels_without_the_channels_axis():
    with pytest.raises(
        ValueError, match=r"pixels of shape \[28, 28\] are not \[..., C, H, W\] with C = 1"
    ):
        normalise(np.zeros((28, 28)), preprocessing([0.5], [0.5]))
    with pytest.raises(ValueError, match="with C = 3"):
        normalise(np.zeros((2, 1, 4, 4)), preprocessing([0.5] * 3, [0.5] * 3))


class FixedBatchSession:
    """Stands in for an onnxruntime session whose graph takes exactly 4 images: [N, 2] -> N x 2."""

    def get_inputs(self):
        return [SimpleNamespace(name="images", shape=[4, 2])]

    def run(self, names, feed):
        (batch,) = feed.values()
        assert names == ["logits"] and batch.shape == (4, 2), batch.shape
        return [batch * 10.0]


def test_the_loop_keeps_order_and_pads_the_last_batch_of_a_fixed_batch_graph():
    images = np.arange(20, dtype=np.float32).reshape(10, 2)
    logits = dataset_logits(onnx_runner(FixedBatchSession()), images, lambda x: x + 1, 4)
    np.testing.assert_array_equal(logits, (images + 1) * 10.0)


# -- report ------------------------------------------------------------------------------------
def test_report_writes_results_and_plots(reported):
    run, results = reported
    assert json.loads((run / "results.json").read_text()) == results
    assert results["dataset"] == "fashion-mnist" and results["images"] == 10_000
    confusion = np.array(results["confusion_matrix"])
    assert confusion.shape == (10, 10) and confusion.sum() == 10_000
    assert (confusion.sum(axis=1) == 1000).all()  # Fashion-MNIST's test split is balanced
    assert results["correct"] == np.trace(confusion)
    assert results["accuracy"] == pytest.approx(np.trace(confusion) / 10_000)
    assert results["accuracy"] > 0.6
    per_class = results["per_class_accuracy"]
    assert list(per_class) == list(get_dataset_spec("fashion-mnist").labels)
    assert per_class["Trouser"] == pytest.approx(confusion[1, 1] / 1000)
    assert 0 < results["loss"] < np.log(10)
    assert results["epoch"] == 6 and results["parameters"] == 19_658
    _, test = load_dataset("fashion-mnist")
    assert [int(test.labels[i]) for i in results["gallery_test_indices"]] == list(range(10))
    for name in ("curves.png", "confusion_matrix.png", "attention_gallery.png"):
        image = matplotlib.image.imread(run / name)
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert image.shape[0] > 300 and image.shape[1] > 300 and image[..., :3].std() > 0.05, name
    assert results["plots"] == ["curves.png", "confusion_matrix.png", "attention_gallery.png"]


def test_report_accuracy_agrees_with_the_training_loop_evaluation(reported):
    run, results = reported
    model, _ = load_checkpoint(run)
    spec = get_dataset_spec("fashion-mnist")
    _, test = load_dataset("fashion-mnist")
    _, accuracy, predictions = evaluate_split(model, test, spec, model.head.weight.device)
    assert accuracy == pytest.approx(results["accuracy"], abs=1e-6)
    confusion = np.zeros((10, 10), dtype=int)
    np.add.at(confusion, (test.labels.numpy(), predictions.numpy()), 1)
    assert confusion.tolist() == results["confusion_matrix"]


def test_report_cli_names_a_missing_checkpoint(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert f"{tmp_path}/model.safetensors: no such checkpoint file" in capsys.readouterr().err


def test_learning_curves_keep_the_last_row_of_a_repeated_epoch(tmp_path):
    path = tmp_path / "metrics.csv"
    header = "epoch,train_loss,train_accuracy,val_loss,val_accuracy,learning_rate,seconds\n"
    path.write_text(
        header + "1,2,0.1,2,0.1,0.1,1\n2,1.5,0.2,1.4,0.3,0.1,1\n2,1.4,0.3,1.3,0.4,0.1,1\n"
    )
    rows = report.read_metrics(path)
    assert [row["epoch"] for row in rows] == [1, 2] and rows[1]["val_loss"] == 1.3
    report.plot_curves(rows, tmp_path / "curves.png", {"augment": True, "label_smoothing": 0.1})
    assert matplotlib.image.imread(tmp_path / "curves.png").shape[1] > 300


# -- evaluate ----------------------------------------------------------------------------------
def test_evaluate_cli_on_a_checkpoint(reported, run_module, tmp_path):
    run, results = reported
    out = tmp_path / "evaluation.json"
    completed = run_module("export.evaluate", str(run / "model.safetensors"), "--json", str(out))
    assert completed.returncode == 0, completed.stderr
    evaluation = json.loads(out.read_text())
    assert evaluation["format"] == "checkpoint" and evaluation["dataset"] == "fashion-mnist"
    assert evaluation["accuracy"] == results["accuracy"]
    assert evaluation["confusion_matrix"] == results["confusion_matrix"]
    assert (
        f"accuracy {100 * results['accuracy']:.2f}% ({results['correct']}/10000)"
        in completed.stdout
    )
    rows = [line for line in completed.stdout.splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 10 and rows[9].startswith(" 9 Ankle boot")
    assert [int(n) for n in rows[1].split()[2:12]] == results["confusion_matrix"][1]


def test_evaluate_cli_refuses_a_dataset_that_does_not_fit(reported, capsys):
    run, _ = reported
    assert evaluate.main([str(run), "--dataset", "cifar10"]) == 2
    err = capsys.readouterr().err
    assert "takes 1x28x28 images" in err and "cifar10 has 3x32x32 images" in err


def test_evaluate_cli_refuses_other_files(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"not a model")
    assert evaluate.main([str(path)]) == 2
    assert (
        "expected a .safetensors checkpoint, a run directory or an .onnx model"
        in capsys.readouterr().err
    )


# -- pipeline and ONNX evaluation ---------------------------------------------------------------
def test_pipeline_trains_exports_and_measures_the_onnx_file(piped, reported):
    run, repo, code = piped
    _, checkpoint_results = reported
    assert code == 0
    version = repo / "tiny" / "2"
    assert (version / "model.onnx").is_file() and (version / "attention.onnx").is_file()
    for name in ("results.json", "curves.png", "confusion_matrix.png", "attention_gallery.png"):
        assert (run / name).is_file(), name
    state = json.loads((run / "last" / "state.json").read_text())
    assert state["epoch"] == 6  # resumed a finished run: nothing more was trained
    evaluation = json.loads((run / "onnx_evaluation.json").read_text())
    assert evaluation["format"] == "onnx" and evaluation["source"] == str(version / "model.onnx")
    assert evaluation["images"] == 10_000
    assert evaluation["accuracy"] == pytest.approx(checkpoint_results["accuracy"], abs=2e-4)
    assert evaluation["loss"] == pytest.approx(checkpoint_results["loss"], abs=1e-4)
    assert onnx_metadata(version / "model.onnx")["test_accuracy"] == pytest.approx(
        evaluation["accuracy"], abs=2e-4
    )


def test_evaluate_onnx_picks_the_newest_version_of_a_repository_entry(piped):
    _, repo, _ = piped
    kind, path = evaluate.resolve_source(repo / "tiny")
    assert kind == "onnx" and path == repo / "tiny" / "2" / "model.onnx"


def test_evaluate_onnx_on_the_attention_graph_gives_the_same_accuracy(piped):
    run, repo, _ = piped
    results = evaluate_onnx(repo / "tiny" / "2" / "attention.onnx", threads=1)
    assert results["accuracy"] == json.loads((run / "onnx_evaluation.json").read_text())["accuracy"]


def test_evaluate_onnx_preprocesses_as_the_metadata_says(piped, tmp_path):
    _, repo, _ = piped
    model = onnx.load(str(repo / "tiny" / "2" / "model.onnx"))
    document = onnx_metadata(repo / "tiny" / "2" / "model.onnx")
    baseline = evaluate_onnx(repo / "tiny" / "2" / "model.onnx", threads=1)
    document["preprocessing"]["mean"] = [0.9]  # a wrong mean must show up as a worse accuracy
    onnx.helper.set_model_props(model, {"vitserve": json.dumps(document)})
    onnx.save(model, tmp_path / "shifted.onnx")
    shifted = evaluate_onnx(tmp_path / "shifted.onnx", threads=1)
    assert shifted["accuracy"] < baseline["accuracy"] - 0.1


def test_evaluate_onnx_refuses_a_model_without_metadata(piped, tmp_path):
    _, repo, _ = piped
    model = onnx.load(str(repo / "tiny" / "2" / "model.onnx"))
    del model.metadata_props[:]
    onnx.save(model, tmp_path / "bare.onnx")
    with pytest.raises(EvaluationError, match="no 'vitserve' entry in its ONNX metadata_props"):
        evaluate_onnx(tmp_path / "bare.onnx")


def test_pipeline_refuses_an_explicit_resume():
    with pytest.raises(SystemExit):
        pipeline.main(["--out", "x", "--name", "n", "--version", "1", "--resume", "x"])


def test_pipeline_builds_the_commands_it_runs(tmp_path):
    run, models = str(tmp_path / "run"), str(tmp_path / "models")
    given = ["--name", "m", "--version", "3", "--repo", models, "--data-dir", "/d"]
    args, rest = pipeline.parse_args(
        ["--preset", "fashion-small", "--out", run, *given, "--epochs", "40", "--overwrite"]
    )
    assert rest == ["--preset", "fashion-small", "--epochs", "40"]
    assert pipeline.train_argv(args, rest) == [*rest, "--out", run, "--data-dir", "/d"]
    assert pipeline.export_argv(args) == [run, *given, "--overwrite"]
    (tmp_path / "run" / "last").mkdir(parents=True)
    (tmp_path / "run" / "last" / "state.json").write_text("{}")
    assert pipeline.train_argv(args, rest)[-2:] == ["--resume", str(tmp_path / "run")]


def test_evaluate_cli_on_a_repository_entry_shows_the_claimed_accuracy(piped, capsys):
    run, repo, _ = piped
    assert evaluate.main([str(repo / "tiny"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    measured = json.loads((run / "onnx_evaluation.json").read_text())
    assert f"{repo / 'tiny' / '2' / 'model.onnx'} (onnx, sha256 {measured['sha256'][:12]})" in out
    assert f"accuracy {100 * measured['accuracy']:.2f}%" in out
    claimed = onnx_metadata(repo / "tiny" / "2" / "model.onnx")["test_accuracy"]
    assert f"the model's metadata claims test accuracy {100 * claimed:.2f}%" in out


def test_evaluate_onnx_refuses_a_model_that_expects_other_polarity(piped, tmp_path):
    _, repo, _ = piped
    model = onnx.load(str(repo / "tiny" / "2" / "model.onnx"))
    document = onnx_metadata(repo / "tiny" / "2" / "model.onnx")
    document["preprocessing"]["polarity"] = "dark-on-light"
    onnx.helper.set_model_props(model, {"vitserve": json.dumps(document)})
    onnx.save(model, tmp_path / "inverted.onnx")
    with pytest.raises(EvaluationError, match="expects dark-on-light images, fashion-mnist holds"):
        evaluate_onnx(tmp_path / "inverted.onnx")


def test_pipeline_reports_a_missing_dataset_without_a_traceback(tmp_path, capsys):
    code = pipeline.main(
        [
            "--out",
            str(tmp_path / "run"),
            "--name",
            "m",
            "--version",
            "1",
            "--repo",
            str(tmp_path / "models"),
            "--data-dir",
            str(tmp_path / "no-data"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"directory {tmp_path / 'no-data'} does not exist" in err
    assert not (tmp_path / "models").exists()
