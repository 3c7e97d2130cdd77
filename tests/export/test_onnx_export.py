"""ONNX export: parity with PyTorch, self-describing metadata, Triton layout, refusals."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import onnx as onnx_export
from export import onnx_graphs, quantize, repository
from export.checkpoint import CheckpointError, load_checkpoint
from export.data import get_dataset_spec, load_dataset, normalize
from export.model import VisionTransformer
from export.report import plot_curves
from export.repository import RepositoryError, write_version
from service.contract.model_config import read_model_config
from service.contract.model_repository import Preprocessing
from service.contract.preprocessing import normalise
from tests.export.runs import init_from_args, save_altered_copy
from tests.support import FASHION_INPUT, made_once


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory) -> tuple[Path, dict]:
    """A repository holding tiny_run's ``tiny`` version 3, and the figures of its export; made
    once for every xdist worker (``made_once``): tests only read it, or a copy."""

    def make(directory: Path) -> None:
        result = onnx_export.export_model(tiny_run, "tiny", 3, directory / "repo")
        (directory / "figures.json").write_text(json.dumps(result))

    directory = made_once(tmp_path_factory, "tiny", make)
    return directory / "repo", json.loads((directory / "figures.json").read_text())


def metadata_of(path: Path) -> dict:
    model = onnx.load(str(path))
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props["vitserve"])


def own_copy(shared: Path, tmp_path: Path) -> Path:
    """A copy of a directory the test's xdist workers share (``made_once``), for a model card to
    write into: the card writes the run's report and plots, and itself beside the model's entry."""
    return Path(shutil.copytree(shared, tmp_path / shared.name))


def test_writes_the_triton_layout(exported):
    repo, result = exported
    entry = repo / "tiny"
    assert sorted(p.name for p in entry.iterdir()) == ["3", "config.pbtxt"]
    assert sorted(p.name for p in (entry / "3").iterdir()) == [
        "attention.onnx",
        "labels.txt",
        "model.onnx",
    ]
    assert (entry / "3" / "labels.txt").read_text().splitlines()[1] == "Trouser"
    config = read_model_config(entry / "config.pbtxt")
    assert config.name == "tiny" and config.platform == "onnxruntime_onnx"
    assert list(config.input[0].dims) == [1, 28, 28] and list(config.output[0].dims) == [10]
    assert config.output[0].label_filename == "3/labels.txt"
    assert (entry / "3").stat().st_mode & 0o755 == 0o755
    assert result["path"] == str(entry / "3")


def test_verification_figures_are_within_tolerance(exported):
    _, result = exported
    assert set(result["verification"]) == {"batch_1", "batch_7", "batch_64"}
    for row in result["verification"].values():
        assert row["logits_max_abs_diff"] <= 1e-4
        assert row["attention_max_abs_diff"] <= 1e-4
        assert row["argmax_mismatches"] == 0


def test_the_classifier_is_the_attention_graph_without_its_maps(exported):
    """model.onnx comes from the explicit softmax path (measured faster in onnxruntime than the
    exporter's spelling of scaled_dot_product_attention), so it holds no operator that the attention
    graph does not, but the two Slice nodes that keep the class token's row through the last block
    (its queries and its residual: ``VisionTransformer.read_rows``)."""
    repo, _ = exported
    version = repo / "tiny" / "3"
    classifier, attention = (
        Counter(node.op_type for node in onnx.load(str(version / name)).graph.node)
        for name in ("model.onnx", "attention.onnx")
    )
    assert classifier["Softmax"] == attention["Softmax"] > 0
    only_classifier = classifier - attention
    assert only_classifier == Counter({"Slice": 2}), f"only in model.onnx: {dict(only_classifier)}"


def test_graphs_have_a_dynamic_batch_axis_and_match_pytorch(exported, tiny_run):
    repo, _ = exported
    model, _ = load_checkpoint(tiny_run)
    spec = get_dataset_spec("fashion-mnist")
    _, test = load_dataset("fashion-mnist")
    images = normalize(test.images[:13], spec)
    classifier = ort.InferenceSession(str(repo / "tiny/3/model.onnx"))
    attention = ort.InferenceSession(str(repo / "tiny/3/attention.onnx"))
    assert [o.name for o in classifier.get_outputs()] == ["logits"]
    assert [o.name for o in attention.get_outputs()] == ["logits", "attention"]
    assert not isinstance(classifier.get_inputs()[0].shape[0], int)
    (logits,) = classifier.run(None, {"images": images.numpy()})
    _, maps = attention.run(None, {"images": images.numpy()})
    with torch.inference_mode():
        expected_logits, expected_maps = model.forward_with_attention(images)
    np.testing.assert_allclose(logits, expected_logits.numpy(), atol=1e-4)
    c = model.config
    assert maps.shape == (13, c.depth, c.heads, c.num_tokens, c.num_tokens)
    np.testing.assert_allclose(maps, expected_maps.numpy(), atol=1e-4)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)


def test_metadata_describes_the_model(exported, tiny_run):
    repo, result = exported
    document = metadata_of(repo / "tiny/3/model.onnx")
    assert document["graph"] == "classifier"
    assert metadata_of(repo / "tiny/3/attention.onnx")["graph"] == "attention"
    assert document["name"] == "tiny" and document["version"] == 3
    assert document["labels"][0] == "T-shirt/top" and len(document["labels"]) == 10
    low, high = document["input"].pop("range")  # what the preprocessing gives, widened
    assert document["input"] == FASHION_INPUT
    assert (low, high) == pytest.approx((-3.6431, 4.8555), abs=1e-4)
    pre = document["preprocessing"]
    assert pre["mean"] == [0.2860] and pre["std"] == [0.3530]
    assert pre["polarity"] == "light-on-dark" and pre["color"] == "grayscale"
    assert document["patch"] == {"size": 7, "grid": [4, 4]}
    assert document["pooling"] == "token" and document["tokens"] == 17
    assert document["dataset"] == "fashion-mnist"
    assert document["test_images"] == 10000
    assert document["test_accuracy"] == result["test_accuracy"]
    assert 0.5 < document["test_accuracy"] <= 1.0
    assert len(document["checkpoint_sha256"]) == 64
    assert document["tools"]["torch"] == torch.__version__
    assert document["model_config"]["dim"] == 32


def test_no_build_machine_paths_or_stack_traces(exported):
    repo, _ = exported
    for name in ("model.onnx", "attention.onnx"):
        model = onnx.load(str(repo / "tiny/3" / name))
        assert all(
            len(node.metadata_props) == 0 and not node.doc_string for node in model.graph.node
        )
        raw = (repo / "tiny/3" / name).read_bytes()
        assert str(Path(__file__).resolve().parents[2]).encode() not in raw
        assert b"stack_trace" not in raw and b"site-packages" not in raw


def test_existing_version_is_not_overwritten_without_the_flag(exported, tiny_run, run_module):
    repo, _ = exported
    before = (repo / "tiny/3/model.onnx").stat().st_mtime_ns
    completed = run_module(
        "export.onnx",
        str(tiny_run),
        "--name",
        "tiny",
        "--version",
        "3",
        "--repo",
        str(repo),
        "--skip-accuracy",
        timeout=300,
    )
    assert completed.returncode == 1
    assert "already exists" in completed.stderr and "--overwrite" in completed.stderr
    assert (repo / "tiny/3/model.onnx").stat().st_mtime_ns == before


def test_a_broken_export_is_refused_and_writes_nothing(tiny_run, tmp_path, monkeypatch, capsys):
    """Graphs whose logits are 1.0003 times PyTorch's: off by three times the tolerance (1e-4 of the
    logits' largest magnitude) at every batch size, and no prediction changes. A tenfold loosening
    of LOGITS_TOLERANCE lets this export through, so the tolerance is pinned, not its boundary."""
    real_build = onnx_export.build_graphs

    def build_from_tampered_weights(model):
        tampered, _ = load_checkpoint(tiny_run)
        with torch.no_grad():
            tampered.head.weight.mul_(1.0003)
            tampered.head.bias.mul_(1.0003)
        return real_build(tampered)

    monkeypatch.setattr(onnx_export, "build_graphs", build_from_tampered_weights)
    code = onnx_export.main(export_args(tiny_run, tmp_path, 1, "--skip-accuracy"))
    assert code == 1
    err = capsys.readouterr().err
    assert "nothing written" in err and "figures" in err
    found = re.findall(
        r"batch \d+: logits differ by ([0-9.e-]+) \(more than 0.0001 of their largest "
        r"magnitude, ([0-9.e+-]+)\)",
        err,
    )
    assert len(found) == 3, err  # batches 1, 7 and 64, the classifier graph
    ratios = [float(difference) / float(scale) for difference, scale in found]
    assert all(abs(ratio - 3e-4) < 1.5e-5 for ratio in ratios), ratios
    assert "argmax mismatches" not in err  # no prediction changed: only the tolerance caught it
    assert not (tmp_path / "tiny" / "1").exists()


def test_refuses_a_checkpoint_that_is_not_safetensors(tmp_path, capsys):
    pickled = tmp_path / "model.pt"
    torch.save({"weights": torch.zeros(2)}, pickled)
    code = onnx_export.main(
        [str(pickled), "--name", "x", "--version", "1", "--repo", str(tmp_path / "repo")]
    )
    assert code == 1
    assert "not a safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_rejects_bad_version_and_name(tiny_run, tmp_path):
    with pytest.raises(SystemExit):
        onnx_export.main([str(tiny_run), "--name", "x", "--version", "0", "--repo", str(tmp_path)])
    with pytest.raises(SystemExit):
        onnx_export.main(
            [str(tiny_run), "--name", "../x", "--version", "1", "--repo", str(tmp_path)]
        )


def test_model_card_reports_the_onnx_accuracy(exported, tiny_run, tmp_path):
    from export.model_card import write_model_card

    repo, result = exported
    entry = own_copy(repo / "tiny", tmp_path)
    card = write_model_card(own_copy(tiny_run, tmp_path / "run"), entry, version=3)
    text = card.read_text()
    assert f"{100 * result['test_accuracy']:.2f}%" in text
    assert "python -m export.train --preset test-tiny --dataset fashion-mnist" in text
    assert "python -m export.evaluate" in text and "| Trouser |" in text
    for plot in ("curves.png", "confusion_matrix.png", "attention_gallery.png"):
        assert (entry / "card" / plot).stat().st_size > 0


def test_onnxruntime_fuses_every_blocks_gelu_and_the_card_says_so(exported, tiny_run, tmp_path):
    """The exported GELU is the pattern onnxruntime fuses (with fc1's bias, BiasGelu), q, k, v
    are three products rather than one cut by Split and Squeeze, and the queries come scaled by
    their weights (the scores a MatMul, not a scaled FusedMatMul); the count recorded at export
    is what the model card shows."""
    from export.model_card import write_model_card

    repo, _ = exported
    depth = load_checkpoint(tiny_run)[0].config.depth
    fusions = metadata_of(repo / "tiny/3/model.onnx")["onnxruntime_fusions"]
    assert fusions["BiasGelu"] == depth
    assert "FusedMatMul" not in fusions
    assert "onnxruntime_fusions" not in metadata_of(repo / "tiny/3/attention.onnx")
    raw = Counter(node.op_type for node in onnx.load(str(repo / "tiny/3/model.onnx")).graph.node)
    assert raw["Squeeze"] == raw["Split"] == 0
    run, entry = own_copy(tiny_run, tmp_path / "run"), own_copy(repo / "tiny", tmp_path)
    text = write_model_card(run, entry, version=3).read_text()
    assert f"BiasGelu x{depth}" in text and "onnxruntime's fusions" in text


def test_model_card_refuses_an_entry_from_another_checkpoint(exported, tiny_run, tmp_path):
    from export.model_card import write_model_card

    repo, _ = exported
    other = tmp_path / "other"
    shutil.copytree(tiny_run, other)
    save_altered_copy(tiny_run, other / "model.safetensors")
    with pytest.raises(ValueError, match="another checkpoint"):
        write_model_card(other, repo / "tiny", version=3)


@pytest.mark.slow
def test_model_card_lists_every_run_a_model_was_trained_in(
    tiny_run, tiny_preset, tmp_path, monkeypatch
):
    from export import model_card, train

    parent = tmp_path / "parent"
    shutil.copytree(tiny_run, parent)
    child = tmp_path / "child"
    assert train.main(init_from_args(tiny_preset, parent, child)) == 0
    onnx_export.export_model(child, "tiny", 1, tmp_path / "repo", measure=False)
    plotted = []

    def record(rows, path, *args, **kwargs):
        plotted.append((path, rows, kwargs))
        return plot_curves(rows, path, *args, **kwargs)

    monkeypatch.setattr(model_card, "plot_curves", record)
    text = model_card.write_model_card(child, tmp_path / "repo" / "tiny").read_text()
    commands = [line for line in text.splitlines() if line.startswith("python -m export.train")]
    assert len(commands) == 2, text
    # Reproductions go to new directories, the second starting from the first's.
    assert commands[0].endswith("--out runs/parent") and "--init-from" not in commands[0]
    assert "--init-from runs/parent " in commands[1] and commands[1].endswith("--out runs/child")
    assert f"- `{parent}`: 6 of 6 epochs run" in text
    assert f"- `{child}`: 1 of 1 epochs run" in text
    assert "of the last run (epoch 7 counting every run)" in text
    [(_, rows, options)] = [call for call in plotted if call[0].parent.name == "card"]
    assert [row["epoch"] for row in rows] == list(range(1, 8))
    assert options["restarts"] == (6,) and options["best"]["epoch"] == 7
    assert options["best_label"] == "epoch 1 of run 2 (epoch 7 counting every run)"

    save_altered_copy(parent, parent / "model.safetensors")
    with pytest.raises(ValueError, match="has changed since"):
        model_card.write_model_card(child, tmp_path / "repo" / "tiny")


def test_model_card_finds_a_parent_recorded_relative_to_the_repository(tmp_path, monkeypatch):
    from export.lineage import REPO, locate_parent

    monkeypatch.chdir(tmp_path)  # training ran from the repository root; the card runs elsewhere
    found = locate_parent("checkpoints/fashion-small")
    assert found == REPO / "checkpoints" / "fashion-small" / "model.safetensors"
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        locate_parent("checkpoints/no-such-run")


# -- the repository writer: a version is written whole, and belongs to itself ---------------------
def tiny_graph(scale: float) -> onnx.ModelProto:
    """images [N, 1, 2, 2] -> logits [N, 4]: a stand-in graph, cheap to write."""
    h = onnx.helper
    nodes = [
        h.make_node("Flatten", ["images"], ["flat"]),
        h.make_node("Mul", ["flat", "scale"], ["logits"]),
    ]
    scale_init = onnx.numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale")
    graph = h.make_graph(
        nodes,
        "tiny",
        [h.make_tensor_value_info("images", onnx.TensorProto.FLOAT, ["N", 1, 2, 2])],
        [h.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 4])],
        [scale_init],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)


def write(repo: Path, version: int, labels=("a", "b", "c", "d"), scale=1.0, **kwargs) -> Path:
    files = {"model.onnx": tiny_graph(scale), "attention.onnx": tiny_graph(-scale)}
    return write_version(repo, "m", version, files, list(labels), (1, 2, 2), **kwargs)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_export_that_fails_midway_leaves_no_version_directory(tmp_path, monkeypatch):
    write(tmp_path, 1)
    config_before = (tmp_path / "m" / "config.pbtxt").read_bytes()
    saved = []

    def save_then_fail(graph, path):
        if saved:
            raise OSError("disk full")
        saved.append(path)
        onnx.save_model(graph, path)

    monkeypatch.setattr(repository.onnx, "save_model", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write(tmp_path, 2, labels=("w", "x", "y", "z"))
    assert saved, "the failure came after the first file was written"
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "config.pbtxt"]
    assert (tmp_path / "m" / "config.pbtxt").read_bytes() == config_before


def test_a_new_version_with_other_labels_leaves_the_old_one_byte_identical(tmp_path):
    first = write(tmp_path, 1)
    before = snapshot(first)
    second = write(tmp_path, 2, labels=("w", "x", "y", "z"), scale=2.0)
    assert snapshot(first) == before
    assert (first / "labels.txt").read_text() == "a\nb\nc\nd\n"
    assert (second / "labels.txt").read_text() == "w\nx\ny\nz\n"
    config = read_model_config(tmp_path / "m" / "config.pbtxt")
    assert config.output[0].label_filename == "2/labels.txt"  # what Triton's latest-1 serves
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "2", "config.pbtxt"]


def test_the_users_serving_settings_are_kept(tmp_path):
    write(tmp_path, 1)
    path = tmp_path / "m" / "config.pbtxt"
    edited = path.read_text().replace("max_batch_size: 16", "max_batch_size: 8")
    edited += "\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n"
    path.write_text(edited)
    write(tmp_path, 2)
    config = read_model_config(path)
    assert config.max_batch_size == 8 and [g.count for g in config.instance_group] == [2, 2]
    write(tmp_path, 1, overwrite=True)  # an older version does not take label_filename back
    assert read_model_config(path).output[0].label_filename == "2/labels.txt"


def test_what_a_config_lacks_is_added_and_what_contradicts_the_graph_is_refused(tmp_path):
    entry = tmp_path / "m"
    entry.mkdir()
    (entry / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    write(tmp_path, 1)
    config = read_model_config(entry / "config.pbtxt")
    assert config.name == "m" and config.max_batch_size == 8
    assert [(t.name, list(t.dims)) for t in config.input] == [("images", [1, 2, 2])]
    assert config.output[0].name == "logits" and config.output[0].label_filename == "1/labels.txt"

    before = (entry / "config.pbtxt").read_text()
    (entry / "config.pbtxt").write_text(before.replace("dims: [1, 2, 2]", "dims: [3, 2, 2]"))
    with pytest.raises(
        RepositoryError, match=r"declares input \[\('images', 'TYPE_FP32', \[3, 2, 2\]\)\]"
    ):
        write(tmp_path, 2)
    (entry / "config.pbtxt").write_text(before.replace('name: "m"', 'name: "other"'))
    with pytest.raises(RepositoryError, match="names the model 'other', its directory is 'm'"):
        write(tmp_path, 2)
    (entry / "config.pbtxt").write_text(before.replace("max_batch_size", "max_batchsize"))
    with pytest.raises(RepositoryError, match=r"config\.pbtxt: line 3, column 1"):
        write(tmp_path, 2)
    assert sorted(p.name for p in entry.iterdir()) == ["1", "config.pbtxt"]


def test_overwrite_replaces_a_version_whole(tmp_path):
    write(tmp_path, 1, labels=("a", "b", "c", "d"))
    with pytest.raises(FileExistsError, match="--overwrite"):
        write(tmp_path, 1)
    version = write(tmp_path, 1, labels=("p", "q", "r", "s"), scale=3.0, overwrite=True)
    assert (version / "labels.txt").read_text() == "p\nq\nr\ns\n"
    (logits,) = ort.InferenceSession(str(version / "model.onnx")).run(
        None, {"images": np.ones((1, 1, 2, 2), np.float32)}
    )
    np.testing.assert_array_equal(logits, np.full((1, 4), 3.0))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "config.pbtxt"]


# -- int8 ----------------------------------------------------------------------------------------
def reduced_export(
    tmp_path_factory, run_module, run: Path, name: str, *options: str
) -> tuple[Path, dict]:
    """``python -m export.onnx RUN --name NAME --version 1 --repo REPO OPTIONS`` as a user runs it,
    once for every xdist worker: the model's entry and the figures it printed."""

    def make(directory: Path) -> None:
        repo = directory / "repo"
        completed = run_module(
            "export.onnx",
            *(str(run), "--name", name, "--version", "1", "--repo", str(repo), *options),
            timeout=600,
        )
        assert completed.returncode == 0, completed.stderr
        (directory / "figures.json").write_text(completed.stdout)

    directory = made_once(tmp_path_factory, name, make)
    return directory / "repo" / name, json.loads((directory / "figures.json").read_text())


@pytest.fixture(scope="module")
def quantized(tiny_run, tmp_path_factory, run_module) -> tuple[Path, dict]:
    options = ("--quantize", "int8", "--quantization", "dynamic")
    return reduced_export(tmp_path_factory, run_module, tiny_run, "tiny-int8", *options)


def test_int8_ships_as_its_own_model_and_says_so(quantized, exported):
    entry, result = quantized
    assert sorted(p.name for p in entry.iterdir()) == ["1", "config.pbtxt"]
    assert sorted(p.name for p in (entry / "1").iterdir()) == ["labels.txt", "model.onnx"]
    document = metadata_of(entry / "1" / "model.onnx")
    assert document["precision"] == "int8" and document["quantization"] == "dynamic"
    assert document["weight_range"] == list(quantize.WEIGHT_RANGE)
    assert document["attention_graph"] is None and document["graph"] == "classifier"
    assert document["name"] == "tiny-int8" and document["labels"][1] == "Trouser"
    _, float_result = exported
    assert document["float_test_accuracy"] == float_result["test_accuracy"]  # the same float graph
    assert document["test_accuracy"] == result["test_accuracy"]
    assert document["float_test_accuracy"] - document["test_accuracy"] <= 0.003
    ops = Counter(node.op_type for node in onnx.load(str(entry / "1" / "model.onnx")).graph.node)
    assert ops["MatMulInteger"] > 0 and ops["DynamicQuantizeLinear"] > 0


def test_int8_predictions_follow_the_float_model(quantized, exported):
    entry, _ = quantized
    repo, _ = exported
    spec = get_dataset_spec("fashion-mnist")
    _, test = load_dataset("fashion-mnist")
    images = normalize(test.images[:500], spec).numpy()
    (int8,) = ort.InferenceSession(str(entry / "1" / "model.onnx")).run(None, {"images": images})
    (fp32,) = ort.InferenceSession(str(repo / "tiny" / "3" / "model.onnx")).run(
        None, {"images": images}
    )
    assert (int8.argmax(1) == fp32.argmax(1)).mean() >= 0.97
    assert 0 < np.abs(int8 - fp32).max() < 0.5 * np.abs(fp32).max()  # close, and not the same
    # the agreement the export records: over the whole test split, recomputed here in the export's
    # batches of 500 (a dynamic int8 graph's scales depend on what is batched together)
    images = normalize(test.images, spec).numpy()
    int8, fp32 = (
        np.concatenate(
            [
                ort.InferenceSession(str(path)).run(None, {"images": images[i : i + 500]})[0]
                for i in range(0, len(images), 500)
            ]
        )
        for path in (entry / "1" / "model.onnx", repo / "tiny" / "3" / "model.onnx")
    )
    recorded = metadata_of(entry / "1" / "model.onnx")["float_agreement"]
    assert recorded["top1_agreement"] == pytest.approx((int8.argmax(1) == fp32.argmax(1)).mean())


def test_static_qdq_is_calibrated_on_training_images(tiny_run, tmp_path, monkeypatch):
    """What calibration protects, measured against the float graph on 2,000 test images: the int8
    graph's top-1 agrees with the float one's and its logits stay close. Measured 98.4% agreement
    and a mean error of 2.0% of the logits' mean magnitude; ranges from raw pixels instead of
    normalised images gave 23% and 118%, from one image instead of 64, 86% and 24%. The bounds
    leave that margin to the CPU's int8 kernels, which the export's 0.3-point accuracy gate did not:
    a 6-epoch tiny model's accuracy moves by tenths of a point between machines (68.44% against the
    float graph's 69.12% on one), so that gate has its own test (below) with a model that fails it
    on any CPU."""
    monkeypatch.setattr(quantize, "MAX_ACCURACY_DROP", 1.0)
    int8 = quantize.Quantization("static-qdq", calibration_count=64)
    onnx_export.export_model(tiny_run, "q", 1, tmp_path, quantization=int8)
    graph = tmp_path / "q" / "1" / "model.onnx"
    document = metadata_of(graph)
    assert document["quantization"] == "static-qdq" and document["calibration_images"] == 64
    assert document["weight_range"] == list(quantize.WEIGHT_RANGE)
    ops = Counter(n.op_type for n in onnx.load(str(graph)).graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0 and not ops["MatMulInteger"]
    model, _ = load_checkpoint(tiny_run / "model.safetensors")
    float_graph = onnx_graphs.classifier_graph(model)  # build_graphs made the attention graph too
    _, test = load_dataset("fashion-mnist")
    images = normalize(test.images[:2000], get_dataset_spec("fashion-mnist")).numpy()
    (int8,) = ort.InferenceSession(str(graph)).run(None, {"images": images})
    (fp32,) = ort.InferenceSession(float_graph.SerializeToString()).run(None, {"images": images})
    assert (int8.argmax(1) == fp32.argmax(1)).mean() >= 0.95
    assert np.abs(int8 - fp32).mean() <= 0.08 * np.abs(fp32).mean()


def test_an_int8_graph_that_loses_accuracy_is_refused(
    tiny_run, tiny_config, tmp_path, capsys, monkeypatch
):
    real_quantize = quantize.quantize_graph

    def quantize_other_weights(graph, method, calibration=None):
        torch.manual_seed(1)
        stranger = onnx_export.classifier_graph(VisionTransformer(tiny_config))
        return real_quantize(stranger, method, calibration)

    monkeypatch.setattr(quantize, "quantize_graph", quantize_other_weights)
    code = onnx_export.main(
        [
            str(tiny_run),
            "--name",
            "q",
            "--version",
            "1",
            "--repo",
            str(tmp_path),
            "--quantize",
            "int8",
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "nothing written" in err and "more than 0.3 points below the float graph's" in err
    assert not (tmp_path / "q").exists()


def test_calibration_images_are_a_seeded_sample_of_the_training_split():
    images = torch.arange(100).view(100, 1, 1, 1)
    chosen = quantize.calibration_images(images, 10)
    assert len(chosen) == 10 and len(set(chosen.flatten().tolist())) == 10
    assert chosen.flatten().tolist() == sorted(chosen.flatten().tolist())
    assert torch.equal(chosen, quantize.calibration_images(images, 10))
    assert not torch.equal(chosen, quantize.calibration_images(images, 10, seed=1))
    with pytest.raises(ValueError, match="--calibration-images must be 1 to 100, got 101"):
        quantize.calibration_images(images, 101)


def test_the_int8_model_card_says_how_it_was_made_and_what_batching_does_to_it(
    quantized, tiny_run, tmp_path
):
    from export.model_card import write_model_card

    entry, result = quantized
    run = own_copy(tiny_run, tmp_path)
    text = write_model_card(run, own_copy(entry, tmp_path)).read_text()
    assert (
        "- Precision: int8 (`dynamic` quantization by onnxruntime, weights in 7 bits (-64 to 64) "
        "so that int8 kernels without VNNI do not saturate)" in text
    )
    assert f"which measured {100 * result['float_test_accuracy']:.2f}% on the same split" in text
    assert (
        f"`python -m export.onnx {run} --name tiny-int8 --version 1 --quantize int8 "
        "--quantization dynamic`" in text
    )
    _, test = load_dataset("fashion-mnist")
    document = metadata_of(entry / "1" / "model.onnx")
    images = normalise(test.images.numpy(), Preprocessing(**document["preprocessing"]))
    session = ort.InferenceSession(str(entry / "1" / "model.onnx"))
    alone = [session.run(None, {"images": images[i : i + 1]})[0] for i in range(len(images))]
    batched = [session.run(None, {"images": images[i : i + 32]})[0] for i in range(0, 10000, 32)]
    changed = int((np.concatenate(alone).argmax(1) != np.concatenate(batched).argmax(1)).sum())
    assert changed > 0  # so that the count is checked, not a constant
    assert f": {changed} of 10000 test images are classified differently at batch 1 and" in text


# -- fp16 ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def half(tiny_run, tmp_path_factory, run_module) -> tuple[Path, dict]:
    return reduced_export(tmp_path_factory, run_module, tiny_run, "tiny-fp16", "--quantize", "fp16")


def test_fp16_ships_as_its_own_model_in_float16_with_float32_at_its_ends(half, exported):
    entry, result = half
    assert sorted(p.name for p in (entry / "1").iterdir()) == ["labels.txt", "model.onnx"]
    graph = onnx.load(str(entry / "1" / "model.onnx"))
    document = metadata_of(entry / "1" / "model.onnx")
    assert document["precision"] == "fp16" and document["quantization"] is None
    assert document["weight_range"] is None and document["calibration_images"] is None
    _, float_result = exported
    assert document["float_test_accuracy"] == float_result["test_accuracy"]
    assert document["test_accuracy"] == result["test_accuracy"]
    assert document["float_test_accuracy"] - document["test_accuracy"] <= 0.003
    ends = [*graph.graph.input, *graph.graph.output]
    assert {e.type.tensor_type.elem_type for e in ends} == {onnx.TensorProto.FLOAT}
    weights = [i for i in graph.graph.initializer if len(i.dims) == 2]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)


def test_fp16_predictions_follow_the_float_model_closely(half, exported):
    """float16 rounds every weight and activation to 11 significant bits: measured on the tiny
    model's 500 test images, logits within 0.005 of float32's (logits of magnitude about 5), every
    class the same."""
    (entry, _), (repo, _) = half, exported
    _, test = load_dataset("fashion-mnist")
    images = normalize(test.images[:500], get_dataset_spec("fashion-mnist")).numpy()
    (fp16,) = ort.InferenceSession(str(entry / "1" / "model.onnx")).run(None, {"images": images})
    (fp32,) = ort.InferenceSession(str(repo / "tiny" / "3" / "model.onnx")).run(
        None, {"images": images}
    )
    assert fp16.dtype == np.float32
    assert (fp16.argmax(1) == fp32.argmax(1)).mean() >= 0.99
    assert 0 < np.abs(fp16 - fp32).max() < 0.05


def test_the_fp16_model_card_says_what_it_is_and_how_it_was_made(half, tiny_run, tmp_path):
    from export.model_card import write_model_card

    entry, result = half
    run = own_copy(tiny_run, tmp_path)
    text = write_model_card(run, own_copy(entry, tmp_path)).read_text()
    assert "- Precision: fp16 (every float32 weight and activation in float16" in text
    assert "made for CUDA, measured here with onnxruntime's CPU provider" in text
    assert f"`python -m export.onnx {run} --name tiny-fp16 --version 1 --quantize fp16`" in text
    agreement = result["float_agreement"]["top1_agreement"]
    assert (
        f"top-1 agreement {100 * agreement:.2f}%; per image, the largest |p_fp16 - p_float|" in text
    )


# -- what a failed export leaves behind ---------------------------------------------------------------


def export_args(run: Path, repo: Path, version: int = 1, *extra: str) -> list[str]:
    return [str(run), "--name", "tiny", "--version", str(version), "--repo", str(repo), *extra]


def test_a_failed_overwrite_keeps_the_old_version_byte_identical(
    exported, tiny_run, tmp_path, monkeypatch, capsys
):
    """`python -m export.onnx ... --overwrite` that fails midway (the disk fills after the first
    graph is written): the version it was to replace is untouched, and no staging is left."""
    # the version to replace: tiny_run's version 3 and its config (not a model card written beside)
    version = Path(shutil.copytree(exported[0] / "tiny" / "3", tmp_path / "tiny" / "3"))
    shutil.copy(exported[0] / "tiny" / "config.pbtxt", tmp_path / "tiny")
    before = snapshot(version)
    config_before = (tmp_path / "tiny" / "config.pbtxt").read_bytes()
    saved = []

    def save_then_fail(graph, path):
        if saved:
            raise OSError(28, "No space left on device")
        saved.append(path)
        onnx.save_model(graph, path)

    monkeypatch.setattr(repository.onnx, "save_model", save_then_fail)
    capsys.readouterr()
    code = onnx_export.main(export_args(tiny_run, tmp_path, 3, "--skip-accuracy", "--overwrite"))
    assert code == 1 and saved, "the failure came after the first graph was written"
    err = capsys.readouterr().err
    assert "export failed, nothing written" in err and "No space left" in err
    assert snapshot(version) == before
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["3", "config.pbtxt"]
    assert (tmp_path / "tiny" / "config.pbtxt").read_bytes() == config_before


def test_an_overwrite_whose_last_rename_fails_puts_the_old_version_back(tmp_path, monkeypatch):
    """The old version steps aside for the new one; if the new one then cannot be renamed into
    place, the old one returns: the version directory is never left missing."""
    first = write(tmp_path, 1)
    before = snapshot(first)
    real_rename = repository.os.rename

    def rename(source, target):
        if Path(source).name.startswith(repository.STAGING_PREFIX) and Path(target) == first:
            raise OSError(5, "Input/output error")
        real_rename(source, target)

    monkeypatch.setattr(repository.os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        write(tmp_path, 1, labels=("w", "x", "y", "z"), scale=5.0, overwrite=True)
    assert snapshot(first) == before
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "config.pbtxt"]


class ShiftedMaps:
    """An attention graph's session whose maps come out shifted by ``delta``: what an export bug
    in the attention output only (the logits untouched) looks like to the verification."""

    def __init__(self, session: ort.InferenceSession, delta: float) -> None:
        self.session, self.delta = session, delta

    def run(self, names, feed):
        logits, maps = self.session.run(names, feed)
        return [logits, maps + np.float32(self.delta)]


def test_the_attention_maps_are_held_to_the_1e_4_tolerance(tiny_run, tmp_path, monkeypatch, capsys):
    """Maps off by 3e-4 (three times the tolerance; no prediction changes) refuse the export: with
    ATTENTION_TOLERANCE loosened tenfold, to 1e-3, this export would go through."""
    real_session_for = onnx_graphs.session_for

    def session_for(model):
        session = real_session_for(model)
        outputs = [output.name for output in model.graph.output]
        return ShiftedMaps(session, 3e-4) if outputs == ["logits", "attention"] else session

    monkeypatch.setattr(onnx_graphs, "session_for", session_for)
    code = onnx_export.main(export_args(tiny_run, tmp_path, 1, "--skip-accuracy"))
    assert code == 1
    err = capsys.readouterr().err
    differences = re.findall(r"batch \d+: attention maps differ by ([0-9.e-]+)", err)
    assert len(differences) == 3, err  # batches 1, 7 and 64
    assert all(abs(float(d) - 3e-4) < 3e-5 for d in differences), differences
    assert "logits differ by" not in err  # neither graph's logits: only the maps' tolerance
    assert "argmax mismatches" not in err
    assert not (tmp_path / "tiny" / "1").exists()
