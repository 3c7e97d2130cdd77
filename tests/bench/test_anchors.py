"""The anchors get the same images as vitserve, and mosec answers as vitserve does: a real mosec server
(its venv, started as the bench starts it) beside a real vitserve, on the same image. That test is
skipped where the mosec venv is not made (`python -m bench --only compare` makes it, from PyPI)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from bench.baselines.classifier import Classifier
from bench.baselines.venvs import MOSEC
from bench.contenders import servers
from bench.payloads import b64_pngs, oip_png_body, oip_tensor_body, predict_body
from bench.server_process import REPO, running, running_service

MODEL_DIR = REPO / "models" / "fashion-mnist-vit" / "1"
PORTS = range(18170, 18180)  # this test's part of the benchmarks' range


def test_every_body_carries_the_same_image():
    encoded, _ = b64_pngs(2)
    assert json.loads(oip_png_body(encoded))["inputs"] == [
        {"name": "image", "shape": [2, 1], "datatype": "BYTES", "data": encoded}
    ]
    assert [i["b64"] for i in json.loads(predict_body(encoded))["images"]] == encoded
    classifier = Classifier(MODEL_DIR)
    tensors = np.stack([classifier.tensor(e) for e in encoded])
    body = json.loads(oip_tensor_body(tensors, "images", "logits"))
    tensor = body["inputs"][0]
    assert tensor["shape"] == [2, 1, 28, 28] and tensor["datatype"] == "FP32"
    assert np.asarray(tensor["data"]).reshape(2, 1, 28, 28) == pytest.approx(tensors, abs=1e-6)
    assert body["outputs"] == [{"name": "logits"}]


def post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


@pytest.mark.slow
@pytest.mark.skipif(
    not MOSEC.ready(),
    reason=f"the mosec venv is not made ({MOSEC.path.name}; `python -m bench --only compare` "
    "makes it from PyPI)",
)
def test_mosec_answers_what_vitserve_answers(tmp_path):
    mosec = next(s for s in servers(MODEL_DIR, {}, workers=1) if s.key == "mosec")
    body = predict_body(b64_pngs(3)[0][2:])
    with running(
        mosec.argv,
        lambda port: mosec.env(port, MODEL_DIR),
        tmp_path / "mosec.log",
        ports=PORTS,
        name="mosec",
        ready_path=mosec.ready_path,
    ) as theirs:
        answered = post(theirs.url + "/predict", body)
    repository = MODEL_DIR.parents[1]
    log = tmp_path / "vitserve.log"
    with running_service(
        log, ports=PORTS, model_repository=repository, models=MODEL_DIR.parent.name
    ) as ours:
        expected = post(ours.url + "/predict", body)
    assert answered["model"] == expected["model"]
    (mine,), (want,) = answered["predictions"], expected["predictions"]
    assert (mine["label"], mine["index"]) == (want["label"], want["index"])
    assert mine["score"] == pytest.approx(want["score"], abs=1e-5)
