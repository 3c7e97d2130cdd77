"""bench/real_size.py's logic: the photos it sends, the CPU split by process role, the model's time
from vitserve's metrics, the medians and the targets' verdicts, and the DeiT preprocessing its models
declare (against Pillow and numpy by hand)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import onnx
import pytest
from PIL import Image

from bench import real_size
from bench.baselines.classifier import Classifier
from bench.baselines.torch_eager_server import checkpoint_of
from bench.decode import metadata
from bench.graphs import legacy_graph
from bench.heavy_models import config_for, preprocessing_for, write_heavy_model
from bench.machine import CLOCK_TICKS
from bench.real_size_report import (
    LEGACY,
    PHONE,
    PHOTO,
    Point,
    RealSize,
    legacy_ratios,
    summarise,
    verdicts,
)
from bench.server_process import REPO
from export.checkpoint import load_checkpoint
from export.model import VisionTransformer
from export.onnx_graphs import onnxruntime_fusions
from service.contract.candidate_plan import CANDIDATE_VERSION
from service.contract.model_config import read_model_config
from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Preprocessor

SHIPPED = REPO / "models" / "fashion-mnist-vit" / "1"


def test_photo_is_the_centre_four_by_three_at_640_by_480():
    photo = np.zeros((200, 400, 3), np.uint8)  # 2:1; its centre 4:3 is columns 67-332
    photo[:, :60] = (255, 0, 0)  # red outside it, left
    photo[:, 340:] = (0, 0, 255)  # blue outside it, right
    photo[:, 60:340] = (0, 200, 0)
    image = Image.open(io.BytesIO(real_size.photo_jpeg(photo)))
    assert image.format == "JPEG" and image.size == (640, 480)
    pixels = np.asarray(image.convert("RGB"), np.int16)
    assert np.abs(pixels - (0, 200, 0)).max() < 40  # neither red nor blue came in


def test_cpu_is_split_by_each_process_role():
    tick = 1 / CLOCK_TICKS
    before = {1: ("python", 10), 2: ("vitserve-engine", 100), 3: ("vitserve-fronte", 50)}
    after = {
        1: ("python", 12),
        2: ("vitserve-engine", 100 + 30),
        3: ("vitserve-fronte", 50 + 40),
        4: ("vitserve-fronte", 5),  # a front end that started in between counts from 0
    }
    split = real_size.cpu_by_role("vitserve", before, after)
    assert split == pytest.approx(
        {"supervisor": 2 * tick, "engine": 30 * tick, "front end": 45 * tick}
    )
    triton = {7: ("tritonserver", 20), 8: ("triton_python_b", 60)}
    assert real_size.cpu_by_role("triton", {}, triton) == pytest.approx(
        {"front end": 20 * tick, "decode + model": 60 * tick}
    )
    mosec = {5: ("mosec", 9), 6: ("python", 3)}
    assert real_size.cpu_by_role("mosec", {}, mosec) == pytest.approx(
        {"front end": 9 * tick, "decode + model": 3 * tick}
    )
    assert real_size.cpu_by_role("plain", {}, {9: ("python", 4)}) == pytest.approx(
        {"whole server": 4 * tick}
    )


def test_model_time_counts_each_batch_once_over_versions():
    statistics = {
        "model_stats": [
            {
                "name": "vit-tiny",
                "version": "1",
                # two requests shared one batch: their own stats count its time twice
                "inference_stats": {"compute_infer": {"count": 2, "ns": 4_000_000_000}},
                "batch_stats": [
                    {"batch_size": 2, "compute_infer": {"count": 1, "ns": 2_000_000_000}},
                    {"batch_size": 1, "compute_infer": {"count": 3, "ns": "500000000"}},
                ],
            },
            {"name": "vit-tiny", "version": "2", "batch_stats": []},
        ]
    }
    assert real_size.model_run_s(json.dumps(statistics)) == pytest.approx(2.5)
    assert real_size.model_run_s(json.dumps({"model_stats": [{"batch_stats": []}]})) is None
    assert real_size.model_run_s(None) is None


def point(server, c, rps, p50, p99, repeat=0, payload=PHOTO, cpu=None, model_ms=None):
    return Point("tiny", server, payload, c, repeat, rps, p50, p99, 0, cpu or {}, model_ms, False)


def test_summaries_are_medians_over_repeats():
    points = [
        point("vitserve", 16, rps, p50, p99, repeat, cpu={"engine": cpu}, model_ms=m)
        for repeat, (rps, p50, p99, cpu, m) in enumerate(
            [(10, 5, 50, 1.0, 4.0), (30, 7, 70, 3.0, 6.0), (20, 9, 90, 2.0, 5.0)]
        )
    ]
    got = summarise(points)[("tiny", "vitserve", PHOTO, 16)]
    assert (got.images_per_s.median, got.images_per_s.low, got.images_per_s.high) == (20, 10, 30)
    assert (got.p50_ms.median, got.p99_ms.median) == (7, 70)
    assert got.cpu_ms == {"engine": 2.0} and got.model_ms == 5.0


def rows(at16, at64, c1):
    """Points of every server: ``at16``/``at64`` map server -> (images/s, p99); ``c1`` -> p50."""
    points = [point(s, 16, rps, 1, p99) for s, (rps, p99) in at16.items()]
    points += [point(s, 64, rps, 1, p99) for s, (rps, p99) in at64.items()]
    points += [point(s, 1, 1, p50, p50) for s, p50 in c1.items()]
    points.append(point("mosec", 16, 1000, 1, 1, payload=PHONE))  # another photo: not judged
    return summarise(points)


def test_targets_take_the_best_peer_by_images_per_second():
    summaries = rows(
        {"vitserve": (110, 80), "plain": (50, 10), "mosec": (100, 90), "triton": (90, 70)},
        {"vitserve": (109, 80), "plain": (50, 10), "mosec": (100, 90), "triton": (20, 1)},
        {"vitserve": 10.5, "plain": 10, "mosec": 1, "triton": 1},
    )
    got = {v.target: v for v in verdicts(summaries, "tiny")}
    at16 = got["c=16 images/s >= 1.1x the best peer"]
    assert (at16.peer, at16.theirs, at16.met) == ("mosec", 100, True)  # 1.10x
    assert got["c=16 p99 ms lower"].met is True  # 80 < mosec's 90, not plain's 10
    assert got["c=64 images/s >= 1.1x the best peer"].met is False  # 1.09x
    assert got["c=1 p50 ms <= 1.05x plain"].met is True  # 10.5 <= 10.5


def test_targets_fail_on_a_higher_p99_or_a_slow_lone_call_and_say_when_unmeasured():
    summaries = rows(
        {"vitserve": (200, 95), "mosec": (100, 90)},
        {"vitserve": (200, 90)},
        {"vitserve": 10.6, "plain": 10},
    )
    got = {v.target: v for v in verdicts(summaries, "tiny")}
    assert got["c=16 p99 ms lower"].met is False
    assert got["c=1 p50 ms <= 1.05x plain"].met is False
    assert got["c=64 images/s >= 1.1x the best peer"].met is None  # no peer measured there
    assert "not measured" not in got["c=64 images/s >= 1.1x the best peer"].text()
    assert got["c=64 images/s >= 1.1x the best peer"].text().endswith(": -")


def test_section_shows_each_point_the_verdicts_and_what_was_not_measured():
    result = RealSize(["tiny"], {"vitserve": "vitserve, defaults"}, 2.0, 1, ["china"])
    result.points = [point("vitserve", 16, 12.5, 40, 80, cpu={"engine": 3.25}, model_ms=2.5)]
    result.peak_mib["tiny/vitserve"] = 321.0
    result.missing["triton"] = "no venv"
    result.ceiling = {"tiny/1": [30.0, 10.0, 20.0], "tiny/16": [40.0], "small/1": [99.0]}
    text = result.markdown()
    assert "batch 1: 20.0 (10.0-30.0) images/s; batch 16: 40.0 images/s." in text
    assert "99.0" not in text  # another model's
    assert "### ViT-Ti/16 (DeiT-tiny)" in text
    assert "| 640x480 | 16 | vitserve | 12.5 | 40 | 80 | 0 | engine 3.2 | 2.5 | 321 |" in text
    assert "- triton: **not measured**: no venv" in text
    assert "- c=16 images/s >= 1.1x the best peer: 12.5 vs -: -\n" in text


def test_heavy_models_declare_deits_resize_crop_as_pillow_does_it_by_hand():
    document = metadata().model_dump(mode="json")
    document["preprocessing"] = preprocessing_for("resize-crop", None)
    preprocessor = Preprocessor(ModelMetadata.model_validate(document), max_pixels=10**7)
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    # DeiT: shorter side to 256 (bicubic), the centre 224 x 224, ImageNet mean and std
    resized = np.asarray(photo.resize((341, 256), Image.Resampling.BICUBIC), np.float32)
    crop = resized[16:240, 58:282] / 255.0
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    expected = ((crop - mean) / std).transpose(2, 0, 1)
    got = preprocessor.from_image(photo).tensor
    assert got.shape == (3, 224, 224)
    assert np.abs(got - expected).max() < 1e-4
    with pytest.raises(ValueError, match="expected one of fit-pad, resize-crop"):
        preprocessing_for("squash", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "tiny,huge"], "--sizes huge: expected some of tiny,small"),
        (["--levels", "1,x"], "'1,x': expected concurrency levels"),
        (["--servers", "vitserve,torchserve"], "--servers 'vitserve,torchserve': expected some of"),
        (["--servers", ","], "expected some of vitserve,plain,plain-legacy,mosec,triton"),
        (["--anchor-workers", "0"], "--anchor-workers must be 1 or more"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(real_size, "run", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exited:
        real_size.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_each_server_gets_the_jpeg_itself_in_its_own_body(tmp_path):
    jpeg = real_size.photo_jpeg(np.full((30, 40, 3), 128, np.uint8))
    bodies = real_size._bodies(tmp_path, {"grey": jpeg})
    predict = json.loads(bodies[real_size.PREDICT, "grey"].read_bytes())
    assert base64.b64decode(predict["images"][0]["b64"]) == jpeg
    oip = json.loads(bodies[real_size.OIP_PNG, "grey"].read_bytes())["inputs"][0]
    assert (oip["datatype"], oip["shape"]) == ("BYTES", [1, 1])
    assert base64.b64decode(oip["data"][0]) == jpeg


def test_options_plan_the_run_no_phone_photo_with_an_empty_list(tmp_path, monkeypatch, capsys):
    planned = []

    def run(out, plan, command):
        planned.append((plan, command))
        return RealSize(list(plan.sizes), {}, plan.seconds, plan.repeats, [])

    monkeypatch.setattr(real_size, "run", run)
    argv = ["--sizes", "small", "--levels", "16", "--phone-levels", "", "--seconds", "12"]
    argv += ["--servers", "vitserve,plain-legacy", "--anchor-workers", "3"]
    assert real_size.main([*argv, "--results-dir", str(tmp_path)]) == 0
    ((plan, command),) = planned
    assert (plan.sizes, plan.levels, plan.phone_levels) == (("small",), (16,), ())
    assert (plan.servers, plan.anchor_workers) == (("vitserve", "plain-legacy"), 3)
    assert "--phone-levels '' --seconds 12" in command  # shown as a shell would take it
    assert (tmp_path / "real_size.json").is_file()
    defaults = real_size.Plan(("tiny",), (1,), (16,), 1.0, 1)
    assert defaults.servers == real_size.SERVERS and defaults.anchor_workers >= 1


def test_the_legacy_export_carries_the_models_metadata_and_answers_as_its_file(tmp_path):
    model, _ = load_checkpoint(checkpoint_of(SHIPPED))
    # the vitserve file's metadata with a count of its fused nodes, which the legacy file must not take
    shipped = onnx.load(SHIPPED / "model.onnx")
    ours_dir = real_size.write_variant(
        shipped, SHIPPED, tmp_path / "ours", onnxruntime_fusions={"X": 1}
    )
    written = real_size.write_variant(legacy_graph(model), ours_dir, tmp_path / "legacy")
    assert written == tmp_path / "legacy" / "fashion-mnist-vit" / "1"
    ours, theirs = real_size.metadata_document(ours_dir), real_size.metadata_document(written)
    assert theirs["attention_graph"] is None  # the plain server runs model.onnx alone
    own = onnxruntime_fusions(onnx.load(written / "model.onnx"))
    assert theirs["onnxruntime_fusions"] == own  # the legacy graph's own, not vitserve's
    kept = set(ours) | set(theirs)
    kept -= {"attention_graph", "onnxruntime_fusions"}
    assert {key: theirs.get(key) for key in kept} == {key: ours.get(key) for key in kept}
    assert (written / "labels.txt").read_text() == (SHIPPED / "labels.txt").read_text()
    vitserve, legacy = Classifier(SHIPPED), Classifier(written)
    assert legacy.metadata.preprocessing == vitserve.metadata.preprocessing
    rng = np.random.default_rng(0)
    images = rng.normal(size=(4, 1, 28, 28)).astype(np.float32)
    assert np.abs(legacy.logits(images) - vitserve.logits(images)).max() < 1e-4


def test_a_variant_written_as_the_candidate_starts_its_trial(tmp_path):
    repo = tmp_path / "models"
    real_size.write_variant(onnx.load(SHIPPED / "model.onnx"), SHIPPED, repo)
    graph = onnx.load(SHIPPED / "model.onnx")
    written = real_size.write_variant(graph, SHIPPED, repo, 2, candidate=True, precision="int8")
    document = real_size.metadata_document(written)
    assert (document["version"], document["precision"]) == (2, "int8")
    config = read_model_config(repo / "fashion-mnist-vit" / "config.pbtxt")
    assert config.parameters[CANDIDATE_VERSION].string_value == "2"


def test_heavy_models_refuse_weights_of_another_size(tmp_path):
    model = VisionTransformer(config_for("tiny", image=32))
    with pytest.raises(ValueError, match="not a ViT of size 'tiny'"):
        write_heavy_model("tiny", tmp_path, model=model)
    assert not (tmp_path / "vit-tiny").exists()


def test_vitserve_must_match_the_plain_server_on_the_legacy_export_with_a_lower_p99():
    summaries = rows(
        {"vitserve": (18.0, 900), "plain": (18.5, 950), LEGACY: (18.0, 1000)},
        {},
        {},
    )
    got = {v.target: v for v in verdicts(summaries, "tiny")}
    speed, p99 = got[f"c=16 images/s >= 1.0x {LEGACY}"], got[f"c=16 p99 ms lower than {LEGACY}"]
    assert (speed.ours, speed.theirs, speed.peer, speed.met) == (18.0, 18.0, LEGACY, True)
    assert (p99.ours, p99.theirs, p99.met) == (900, 1000, True)
    assert got["c=16 images/s >= 1.1x the best peer"].peer == "plain"  # legacy is no such peer
    assert legacy_ratios(summaries, "tiny") == [
        f"vitserve / {LEGACY} at c=16: images/s 1.00x, p99 0.90x"
    ]
    slower = rows({"vitserve": (17.9, 1000), LEGACY: (18.0, 1000)}, {}, {})
    got = {v.target: v for v in verdicts(slower, "tiny")}
    assert got[f"c=16 images/s >= 1.0x {LEGACY}"].met is False
    assert got[f"c=16 p99 ms lower than {LEGACY}"].met is False  # equal is not lower
    unmeasured = {v.target for v in verdicts(rows({"vitserve": (1, 1)}, {}, {}), "tiny")}
    assert not any(LEGACY in target for target in unmeasured)
