"""A candidate version on live traffic, served: the shadow comparison, the canary, promotion and rollback.

The repository holds version 1 of the tiny model and a version 2 whose weights are version 1's plus
noise, so the two disagree on some images. What the service reports is checked against onnxruntime run
here on both versions' files, never against the service's own comparison code.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from onnx import numpy_helper

from service.contract.candidate_plan import (
    CANARY_PERCENT,
    CANDIDATE_VERSION,
    LIVE_VERSION,
    SHADOW_PERCENT,
    SHADOW_TIMEOUT_MS,
)
from service.contract.candidates import CLIENT_KEY_HEADER, judge
from service.contract.model_config import read_model_config, write_model_config
from service.launcher.local_app import local_app
from service.promote import EXIT_PROMOTED, EXIT_ROLLED_BACK, EXIT_WAIT, Thresholds, decide
from tests.support import (
    MODEL_NAME,
    SERVICE,
    Reference,
    assert_error,
    make_settings,
    metric,
    running_server,
    wait_until,
)


def perturb(model_file: Path, seed: int = 2, scale: float = 0.15) -> None:
    """Every float weight of ``model_file`` plus Gaussian noise of ``scale`` times its spread."""
    model = onnx.load(model_file)
    rng = np.random.default_rng(seed)
    for weight in model.graph.initializer:
        values = numpy_helper.to_array(weight)
        if values.dtype == np.float32 and values.size > 1:
            noise = rng.standard_normal(values.shape).astype(np.float32)
            changed = values + noise * np.float32(scale * (values.std() or 1.0))
            weight.CopyFrom(numpy_helper.from_array(changed.astype(np.float32), weight.name))
    onnx.save(model, model_file)


def configure(repository: Path, **parameters: object) -> None:
    """Serve versions 1 and 2, with ``parameters`` (vitserve's) in the model's config.pbtxt."""
    path = repository / MODEL_NAME / "config.pbtxt"
    config = read_model_config(path)
    config.version_policy.specific.versions[:] = [1, 2]
    for key in list(config.parameters):
        del config.parameters[key]
    for key, value in parameters.items():
        config.parameters[key].string_value = str(value)
    write_model_config(config, path)


@pytest.fixture
def repository(model_repository: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    shutil.copytree(copy / MODEL_NAME / "1", copy / MODEL_NAME / "2")
    perturb(copy / MODEL_NAME / "2" / "model.onnx")
    (copy / MODEL_NAME / "2" / "attention.onnx").unlink()  # it would disagree with model.onnx
    return copy


def serve(repository: Path, **settings: object) -> TestClient:
    return TestClient(local_app(make_settings(repository, **settings)))


def body(image: np.ndarray) -> dict:
    return {"images": [{"pixels": image.tolist()}]}


def probabilities(model_file: Path, images: np.ndarray) -> np.ndarray:
    """Softmax of the version's logits, computed here with onnxruntime on the file itself."""
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": Reference.normalise(images)})
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def shadow(client: TestClient) -> dict:
    response = client.get(f"/models/{MODEL_NAME}/shadow")
    assert response.status_code == 200, response.text
    return response.json()


def compared(client: TestClient, images: int) -> dict:
    return wait_until(
        lambda: (
            (pair := (shadow(client)["pairs"] or [{}])[0]).get("images_compared") == images and pair
        ),
        f"{images} images compared",
    )


# the per-test timeout counts this test's body only: its fixtures (the session's tiny-model export,
# when it is the first test to need it, and the dataset) took most of the 120 s on a busy machine
@pytest.mark.timeout(func_only=True)
def test_the_comparison_agrees_with_onnxruntime_on_both_versions(repository, fashion_images):
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    candidate = probabilities(repository / MODEL_NAME / "2" / "model.onnx", fashion_images)
    live_top, candidate_top = live.argmax(axis=1), candidate.argmax(axis=1)
    differences = np.abs(live - candidate).max(axis=1)
    assert 0 < (live_top == candidate_top).sum() < len(live_top)  # the versions do differ
    with serve(repository) as client:
        for image, expected in zip(fashion_images, live, strict=True):
            response = client.post(f"/models/{MODEL_NAME}/predict", json=body(image))
            answer = response.json()
            assert answer["model"] == {"name": MODEL_NAME, "version": 1}  # live answers, always
            assert answer["predictions"][0]["index"] == int(expected.argmax())
        pair = compared(client, len(fashion_images))
        report = shadow(client)
        metrics = client.get("/metrics").text
    assert (report["live_version"], report["candidate_version"]) == (1, 2)
    assert (pair["live_version"], pair["candidate_version"]) == (1, 2)
    assert pair["requests_compared"] == len(fashion_images)
    assert pair["top1_agreement"] == pytest.approx((live_top == candidate_top).mean())
    assert pair["probability_difference"]["mean"] == pytest.approx(differences.mean(), abs=1e-5)
    assert pair["probability_difference"]["p99"] == pytest.approx(
        np.percentile(differences, 99), abs=1e-5
    )
    expected_confusion = Counter(zip(live_top.tolist(), candidate_top.tolist(), strict=True))
    assert {
        (row["live_class"], row["candidate_class"]): row["images"] for row in pair["confusion"]
    } == dict(expected_confusion)
    assert pair["outcomes"]["compared"] == len(fashion_images)
    assert pair["model_ms"]["live_p50"] > 0 and pair["model_ms"]["candidate_p50"] > 0
    labels = {"model": MODEL_NAME, "live": "1", "candidate": "2"}
    assert metric(metrics, "vitserve_shadow_images_total", **labels) == len(fashion_images)
    assert (
        metric(metrics, "vitserve_shadow_top1_agreements_total", **labels)
        == (live_top == candidate_top).sum()
    )


def retag(model_file: Path, **changes: dict) -> None:
    """Change the version's ``vitserve`` metadata: each of ``changes`` updates one of its sections
    (``input``, ``preprocessing``) or, for ``labels``, replaces them."""
    model = onnx.load(model_file)
    entry = next(p for p in model.metadata_props if p.key == "vitserve")
    metadata = json.loads(entry.value)
    for section, values in changes.items():
        if isinstance(values, dict):
            updated = {**metadata[section], **values}
            metadata[section] = {k: v for k, v in updated.items() if v is not None}
        else:
            metadata[section] = values
    entry.value = json.dumps(metadata)
    onnx.save(model, model_file)


def shadow_all(repository: Path, images: np.ndarray) -> tuple[dict, dict]:
    """Every image sent to the live version once (100% shadow); the comparison's report and pair."""
    with serve(repository) as client:
        for image in images:
            response = client.post(f"/models/{MODEL_NAME}/predict", json=body(image))
            assert response.status_code == 200, response.text
            assert response.json()["model"]["version"] == 1
        report = shadow(client)
        if report["comparable"]:
            compared(client, len(images))
        return shadow(client), (shadow(client)["pairs"] or [{}])[0]


def test_a_version_equal_in_effect_is_compared_on_the_same_rows(repository, fashion_images):
    """A fresh export records ``input.range`` and the shipped version does not: the rows are the
    same, so every request is compared (it was 0 of N, 'incompatible', when text was compared)."""
    retag(repository / MODEL_NAME / "2" / "model.onnx", input={"range": [-40.0, 40.0]})
    for graph in ("model.onnx", "attention.onnx"):
        retag(repository / MODEL_NAME / "1" / graph, input={"range": None})
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    report, pair = shadow_all(repository, fashion_images)
    assert (report["comparable"], report["rows"]) == (True, "same")
    assert pair["requests_compared"] == len(fashion_images)
    assert pair["outcomes"]["incompatible"] == 0


def test_a_candidate_with_other_preprocessing_is_compared_on_its_own_rows(
    repository, fashion_images
):
    """Version 2 normalises with another mean and std: the front end prepares its own rows from the
    same images. The agreement is checked against onnxruntime run here on each file with each
    version's own normalisation, computed independently."""
    mean, std = 0.5, 0.25
    retag(
        repository / MODEL_NAME / "2" / "model.onnx", preprocessing={"mean": [mean], "std": [std]}
    )
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    session = ort.InferenceSession(
        str(repository / MODEL_NAME / "2" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    own_rows = ((fashion_images.astype(np.float32)[:, None] / 255.0 - mean) / std).astype(
        np.float32
    )
    (logits,) = session.run(None, {"images": own_rows})
    candidate_top = logits.argmax(axis=1)
    agreement = (live.argmax(axis=1) == candidate_top).mean()
    same_rows_top = probabilities(repository / MODEL_NAME / "2" / "model.onnx", fashion_images)
    assert (same_rows_top.argmax(axis=1) != candidate_top).any()  # the rows do matter here
    report, pair = shadow_all(repository, fashion_images)
    assert (report["comparable"], report["rows"]) == (True, "own")
    assert "mean [0.5] against" in report["why"]
    assert pair["requests_compared"] == len(fashion_images)
    assert pair["top1_agreement"] == pytest.approx(agreement)
    expected = Counter(zip(live.argmax(axis=1).tolist(), candidate_top.tolist(), strict=True))
    assert {(r["live_class"], r["candidate_class"]): r["images"] for r in pair["confusion"]} == (
        dict(expected)
    )
    assert pair["model_ms"]["pairs"] >= 1


def test_images_the_candidate_cannot_take_never_fail_the_live_answer(
    repository, fashion_images, monkeypatch
):
    """The candidate's own rows are prepared beside the live ones: when its preprocessing refuses an
    image the live version takes, the caller still gets the live answer, and the copy is counted
    incompatible."""
    from service.errors import InvalidInput
    from service.frontend import serving

    retag(
        repository / MODEL_NAME / "2" / "model.onnx", preprocessing={"mean": [0.5], "std": [0.25]}
    )
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images[:6])
    prepare = serving.prepare_batch

    def candidate_refuses(preprocessor, images, invert, budget):
        if preprocessor.metadata.preprocessing.std == [0.25]:  # the candidate (a copy of 1)
            raise InvalidInput("images[0]: the candidate cannot take this", field="images[0]")
        return prepare(preprocessor, images, invert, budget)

    monkeypatch.setattr(serving, "prepare_batch", candidate_refuses)
    with serve(repository) as client:
        for image, expected in zip(fashion_images[:6], live, strict=True):
            answer = client.post(f"/models/{MODEL_NAME}/predict", json=body(image))
            assert answer.status_code == 200, answer.text
            assert answer.json()["predictions"][0]["index"] == int(expected.argmax())
        pair = wait_until(
            lambda: (
                (p := (shadow(client)["pairs"] or [{}])[0]).get("outcomes", {}).get("incompatible")
                == 6
                and p
            ),
            "6 copies counted incompatible",
        )
        assert shadow(client)["rows"] == "own"
    assert pair["requests_compared"] == 0


def test_a_candidate_at_another_input_size_is_compared_on_its_own_rows(repository, fashion_images):
    """Version 2 is another ViT, 35 x 35 (a model fine-tuned at another resolution), with version
    1's labels and preprocessing: each live request's images are prepared again at its size. Its
    reference answers: onnxruntime on its file, on rows from the contract's preprocessing (tested
    against Pillow and the source libraries in test_preprocessing_*)."""
    import dataclasses

    import torch

    from export.model import VisionTransformer
    from export.onnx_graphs import build_graphs, graph_document, with_metadata
    from service.contract.model_repository import ModelMetadata
    from service.contract.preprocessing import Preprocessor
    from tests.support import TINY

    torch.manual_seed(1)
    model = VisionTransformer(dataclasses.replace(TINY, image_height=35, image_width=35)).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight, std=1.0)
    live_meta = json.loads(
        next(
            p.value
            for p in onnx.load(repository / MODEL_NAME / "1" / "model.onnx").metadata_props
            if p.key == "vitserve"
        )
    )
    version = repository / MODEL_NAME / "2"
    document = graph_document(
        model, live_meta["preprocessing"], live_meta["labels"], MODEL_NAME, 2, "classifier", "0"
    )
    onnx.save(with_metadata(build_graphs(model).classifier, document), version / "model.onnx")
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    prepare = Preprocessor(ModelMetadata.model_validate(document), max_pixels=10**6)
    rows = np.stack(
        [prepare.from_pixels(image.tolist(), "image").tensor for image in fashion_images]
    )
    assert rows.shape[1:] == (1, 35, 35)
    session = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": rows})
    agreement = (live.argmax(axis=1) == logits.argmax(axis=1)).mean()
    report, pair = shadow_all(repository, fashion_images)
    assert (report["comparable"], report["rows"]) == (True, "own")
    assert "input 1x35x35 against 1x28x28" in report["why"]
    assert pair["requests_compared"] == len(fashion_images)
    assert pair["top1_agreement"] == pytest.approx(agreement)


def test_a_candidate_with_other_labels_is_said_incomparable_everywhere(
    repository, fashion_images, caplog
):
    labels = [f"class {i}" for i in range(10)]
    retag(repository / MODEL_NAME / "2" / "model.onnx", labels=labels)
    (repository / MODEL_NAME / "2" / "labels.txt").write_text("\n".join(labels) + "\n")
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    with caplog.at_level(logging.INFO, logger="vitserve"):
        report, pair = shadow_all(repository, fashion_images[:4])
    assert report["comparable"] is False and report["rows"] == "none"
    assert "other labels" in report["why"]
    assert any("other labels" in r.getMessage() for r in caplog.records)  # said at load
    assert pair["requests_compared"] == 0 and pair["outcomes"]["incompatible"] == 4
    verdict = judge(report, Thresholds(0.9, 1, 1.5))
    assert (
        verdict.action == "wait"
        and "0 compared: the candidate has other labels" in (verdict.reasons[0])
    )


def break_candidate(client: TestClient, run) -> None:
    """Version 2's runs, the shadow's among them, go to ``run`` instead of its session."""
    candidate = client.app.state.engine.manager.models[MODEL_NAME].pipeline(2)
    candidate.runtime.classify_with = lambda instance: run


def test_a_shadow_that_fails_or_hangs_never_changes_the_live_answer(repository, fashion_images):
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100, SHADOW_TIMEOUT_MS: 50})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    released = threading.Event()

    def fails(images: np.ndarray) -> tuple[np.ndarray]:
        raise RuntimeError("the candidate is broken")

    def hangs(images: np.ndarray) -> tuple[np.ndarray]:
        released.wait(30)
        raise RuntimeError("released")

    with serve(repository) as client:
        try:
            for run, outcome in ((fails, "failed"), (hangs, "timeout")):
                break_candidate(client, run)
                for image, expected in zip(fashion_images[:6], live, strict=False):
                    answer = client.post(f"/models/{MODEL_NAME}/predict", json=body(image))
                    assert answer.status_code == 200, answer.text
                    prediction = answer.json()["predictions"][0]
                    assert answer.json()["model"]["version"] == 1
                    assert prediction["index"] == int(expected.argmax())
                    for entry in prediction["top_k"]:
                        assert entry["score"] == pytest.approx(expected[entry["index"]], abs=1e-4)
                wait_until(
                    lambda outcome=outcome: shadow(client)["pairs"][0]["outcomes"][outcome] >= 1,
                    f"a shadow counted {outcome}",
                )
        finally:
            released.set()
    assert shadow_report_outcomes_total(client) >= 1


def shadow_report_outcomes_total(client: TestClient) -> int:
    """Nothing was compared: every copy failed, timed out or was shed behind the hung one."""
    pair = client.app.state.engine.shadows.comparisons[(MODEL_NAME, 1, 2)].report()
    assert pair["outcomes"]["compared"] == 0
    return pair["outcomes"]["failed"] + pair["outcomes"]["timeout"]


def binomial_bound(n: int, p: float, sigmas: float = 4.5) -> tuple[float, float]:
    """Where a count of ``n`` draws of probability ``p`` lies but for about 1 run in 150,000."""
    spread = sigmas * math.sqrt(n * p * (1 - p))
    return n * p - spread, n * p + spread


def test_the_canary_answers_its_share_and_says_which_version_did(repository, fashion_images):
    configure(repository, **{CANDIDATE_VERSION: 2, CANARY_PERCENT: 20})
    requests = 600
    with serve(repository) as client:
        versions = Counter(
            client.post(f"/models/{MODEL_NAME}/predict", json=body(fashion_images[0])).json()[
                "model"
            ]["version"]
            for _ in range(requests)
        )
        pinned = client.post(
            f"/models/{MODEL_NAME}/versions/1/predict", json=body(fashion_images[0])
        )
    low, high = binomial_bound(requests, 0.20)
    assert set(versions) == {1, 2}
    assert low <= versions[2] <= high, versions
    assert pinned.json()["model"]["version"] == 1  # a versioned request is never the canary's


def test_a_client_key_always_gets_the_same_version(repository, fashion_images):
    configure(repository, **{CANDIDATE_VERSION: 2, CANARY_PERCENT: 50})
    with serve(repository) as client:
        seen: dict[str, set[int]] = {}
        for key in (f"client-{i}" for i in range(60)):
            for _ in range(4):
                answer = client.post(
                    "/predict", json=body(fashion_images[1]), headers={CLIENT_KEY_HEADER: key}
                )
                seen.setdefault(key, set()).add(answer.json()["model"]["version"])
    assert all(len(versions) == 1 for versions in seen.values()), seen
    low, high = binomial_bound(len(seen), 0.5)
    assert low <= sum(versions == {2} for versions in seen.values()) <= high


def test_promotion_makes_the_candidate_live_and_is_written_to_the_config(
    repository, fashion_images
):
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100, CANARY_PERCENT: 10})
    with serve(repository) as client:
        assert client.post("/predict", json=body(fashion_images[0])).json()["model"]["version"]
        assert_error(
            client.post(f"/models/{MODEL_NAME}/shadow/promote?version=1"), 409, "not version 1"
        )
        decision = client.post(f"/models/{MODEL_NAME}/shadow/promote?version=2")
        assert decision.status_code == 200, decision.text
        assert decision.json() == {
            "model": MODEL_NAME,
            "action": "promote",
            "candidate_version": 2,
            "live_version_before": 1,
            "live_version": 2,
        }
        versions = {
            client.post("/predict", json=body(image)).json()["model"]["version"]
            for image in fashion_images
        }
        report = shadow(client)
        again = client.post(f"/models/{MODEL_NAME}/shadow/rollback")
    assert versions == {2}
    assert report["candidate_version"] is None and report["live_version"] == 2
    assert_error(again, 409, "no candidate version")
    parameters = read_model_config(repository / MODEL_NAME / "config.pbtxt").parameters
    assert {k: v.string_value for k, v in parameters.items()} == {LIVE_VERSION: "2"}
    with serve(repository) as client:  # a restart keeps it: the config says so
        assert client.post("/predict", json=body(fashion_images[0])).json()["model"]["version"] == 2


def test_rollback_ends_the_trial_and_keeps_the_live_version(repository, fashion_images):
    configure(repository, **{CANDIDATE_VERSION: 2, CANARY_PERCENT: 100})
    with serve(repository) as client:
        before = client.post("/predict", json=body(fashion_images[0])).json()["model"]["version"]
        decision = client.post(f"/models/{MODEL_NAME}/shadow/rollback").json()
        after = {
            client.post("/predict", json=body(image)).json()["model"]["version"]
            for image in fashion_images[:8]
        }
    assert before == 2  # the canary at 100% answered every unversioned request
    assert decision["action"] == "rollback" and decision["live_version"] == 1
    # version 2 is the newest loaded, but the live version stays: rollback pins it
    assert after == {1}
    parameters = read_model_config(repository / MODEL_NAME / "config.pbtxt").parameters
    assert {k: v.string_value for k, v in parameters.items()} == {LIVE_VERSION: "1"}


def test_a_config_with_a_bad_share_is_refused_naming_it_and_the_served_one_stays(
    repository, fashion_images
):
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    with serve(repository, model_control="explicit", models=MODEL_NAME) as client:
        configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 150, "vitserve_shaddow": 1})
        refused = client.post(f"/v2/repository/models/{MODEL_NAME}/load")
        configure(repository, **{SHADOW_PERCENT: 5})
        orphan = client.post(f"/v2/repository/models/{MODEL_NAME}/load")
        kept = shadow(client)
        answer = client.post("/predict", json=body(fashion_images[0]))
    assert refused.status_code == 400
    assert "unknown parameters ['vitserve_shaddow']" in refused.json()["error"]
    assert orphan.status_code == 400
    assert "vitserve_shadow_percent needs vitserve_candidate_version" in orphan.json()["error"]
    assert (kept["candidate_version"], kept["shadow_percent"]) == (2, 100)
    assert answer.status_code == 200 and answer.json()["model"]["version"] == 1


def requester(client: TestClient):
    """``python -m service.promote``'s requests, made to an in-process app."""

    def request(method: str, path: str) -> dict:
        answer = client.request(method, path)
        if answer.status_code != 200:
            raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        return answer.json()

    return request


def test_the_promotion_command_decides_on_the_evidence_and_logs_its_numbers(
    repository, fashion_images, caplog
):
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    candidate = probabilities(repository / MODEL_NAME / "2" / "model.onnx", fashion_images)
    agreement = (live.argmax(axis=1) == candidate.argmax(axis=1)).mean()
    strict = Thresholds(min_agreement=0.99, min_requests=24, max_latency_ratio=100.0)
    lenient = Thresholds(min_agreement=agreement, min_requests=24, max_latency_ratio=100.0)
    decisions = logging.getLogger("vitserve.promote")
    decisions.addHandler(caplog.handler)  # the service's loggers do not propagate to the root
    with serve(repository) as client:
        request = requester(client)
        assert decide(request, MODEL_NAME, strict) == EXIT_WAIT  # nothing compared yet
        for image in fashion_images:
            client.post("/predict", json=body(image))
        compared(client, len(fashion_images))
        assert decide(request, MODEL_NAME, strict, dry_run=True) == EXIT_ROLLED_BACK
        assert shadow(client)["candidate_version"] == 2  # a dry run changes nothing
        assert decide(request, MODEL_NAME, lenient) == EXIT_PROMOTED
        answer = client.post("/predict", json=body(fashion_images[0])).json()
    decisions.removeHandler(caplog.handler)
    assert answer["model"]["version"] == 2
    logged = caplog.text
    assert f"top-1 agreement {agreement:.4f} (min 0.99)" in logged
    assert "would rollback (top-1 agreement" in logged
    assert "promoted; live version 1 -> 2" in logged


@pytest.mark.parametrize(("min_agreement", "live_after"), [(0.5, 2), (0.99, 1)])
def test_poll_mode_promotes_or_rolls_back_by_the_models_own_thresholds(
    repository, fashion_images, min_agreement, live_after
):
    """Agreement here is 2/3 (onnxruntime on both files, the first test): 0.5 promotes, 0.99 rolls
    back; either way only once 24 requests were compared."""
    configure(
        repository,
        **{
            CANDIDATE_VERSION: 2,
            SHADOW_PERCENT: 100,
            "vitserve_promote_min_requests": 24,
            "vitserve_promote_min_agreement": min_agreement,
            "vitserve_promote_max_latency_ratio": 100,
        },
    )
    with serve(repository, model_control="poll", repository_poll_s=0.1) as client:
        for image in fashion_images[:23]:
            client.post("/predict", json=body(image))
        compared(client, 23)
        waiting = shadow(client)["candidate_version"]
        client.post("/predict", json=body(fashion_images[23]))
        wait_until(lambda: shadow(client)["candidate_version"] is None, "a decision")
        answer = client.post("/predict", json=body(fashion_images[0])).json()
    assert waiting == 2  # 23 compared: not evidence enough yet
    assert answer["model"]["version"] == live_after
    parameters = read_model_config(repository / MODEL_NAME / "config.pbtxt").parameters
    assert {k: v.string_value for k, v in parameters.items()} == {LIVE_VERSION: str(live_after)}


@pytest.mark.parametrize("rows", ["same", "own"])
def test_the_comparison_and_promotion_over_the_process_link(
    repository, fashion_images, tmp_path, rows
):
    """``python -m service``: the engine in its own process shadows, answers the comparison and
    promotes through the link's control calls; the front ends route by the table it publishes.
    "own": version 2 normalises otherwise, so its own rows travel after each call's rows."""
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    live = probabilities(repository / MODEL_NAME / "1" / "model.onnx", fashion_images)
    candidate = probabilities(repository / MODEL_NAME / "2" / "model.onnx", fashion_images)
    if rows == "own":
        mean, std = 0.5, 0.25
        retag(
            repository / MODEL_NAME / "2" / "model.onnx",
            preprocessing={"mean": [mean], "std": [std]},
        )
        session = ort.InferenceSession(
            str(repository / MODEL_NAME / "2" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        own = (fashion_images.astype(np.float32)[:, None] / 255.0 - mean) / std
        (candidate,) = session.run(None, {"images": own.astype(np.float32)})
    log = tmp_path / "service.log"
    with (
        running_server(repository, log, suite=SERVICE) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        versions = {
            http.post("/predict", json=body(image)).json()["model"]["version"]
            for image in fashion_images
        }
        pair = wait_until(
            lambda: (
                (
                    found := (http.get(f"/models/{MODEL_NAME}/shadow").json()["pairs"] or [{}])[0]
                ).get("images_compared")
                == len(fashion_images)
                and found
            ),
            "every image compared",
        )
        decision = http.post(f"/models/{MODEL_NAME}/shadow/promote", params={"version": 2})
        after = wait_until(
            lambda: (
                {
                    http.post("/predict", json=body(fashion_images[0])).json()["model"]["version"]
                    for _ in range(4)
                }
                == {2}
            ),
            "every front end routing to version 2",
        )
    assert versions == {1}
    agreement = (live.argmax(axis=1) == candidate.argmax(axis=1)).mean()
    assert pair["top1_agreement"] == pytest.approx(agreement)
    assert decision.status_code == 200 and decision.json()["live_version"] == 2
    assert after


def test_a_promotion_under_load_fails_no_request_and_moves_every_answer_once(
    repository, fashion_images, tmp_path
):
    """Four clients post without pause while the candidate is promoted: every answer is 200, each
    client sees version 1 until it first sees version 2 and never version 1 again after that (the
    promotion writes the config and loads the model again while the old pipeline answers what it
    leased)."""
    configure(repository, **{CANDIDATE_VERSION: 2, SHADOW_PERCENT: 100})
    log = tmp_path / "service.log"
    stop = threading.Event()
    seen: dict[int, list[tuple[int, int | None]]] = {client: [] for client in range(4)}

    def post_until_stopped(client: int, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            index = client
            while not stop.is_set():
                try:
                    answer = http.post(
                        "/predict", json=body(fashion_images[index % len(fashion_images)])
                    )
                except httpx.HTTPError as error:  # counted, never lost with the thread
                    seen[client].append((0, repr(error)))  # type: ignore[arg-type]
                    continue
                version = answer.json()["model"]["version"] if answer.status_code == 200 else None
                seen[client].append((answer.status_code, version))
                index += 4

    with (
        running_server(repository, log, suite=SERVICE) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        clients = [
            threading.Thread(target=post_until_stopped, args=(client, server.url))
            for client in seen
        ]
        for thread in clients:
            thread.start()
        wait_until(lambda: all(len(answers) >= 20 for answers in seen.values()), "load")
        decision = http.post(f"/models/{MODEL_NAME}/shadow/promote", params={"version": 2})
        after = {client: len(answers) for client, answers in seen.items()}
        wait_until(
            lambda: all(len(seen[c]) >= after[c] + 40 for c in seen), "load after the promotion"
        )
        stop.set()
        for thread in clients:
            thread.join(timeout=30)
    assert decision.status_code == 200, decision.text
    for client, answers in seen.items():
        statuses = Counter(status for status, _ in answers)
        assert statuses == {200: len(answers)}, (client, statuses)
        versions = [version for _, version in answers]
        first_two = versions.index(2)
        assert set(versions[:first_two]) == {1} and set(versions[first_two:]) == {2}, client
