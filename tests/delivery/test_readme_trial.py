"""The README's "Try a new version on live traffic", run as written on the shipped model.

The commands are read from the README itself (its two code blocks in that section), run in a
directory laid out like a clone (the shipped model's repository copied, ``checkpoints/`` beside it),
against a service in poll mode: version 2 exported from ``checkpoints/fashion-small-stage2`` with the
README's own command, real Fashion-MNIST test images sent one at a time, the README's promotion
command, then the service started again. What the shadow reports is checked against onnxruntime run
here on both versions' files.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

from bench.server_process import running_service
from service.contract.candidate_plan import candidate_plan
from service.contract.model_config import read_model_config
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fashion-mnist-vit"
REQUESTS = 520
MIN_REQUESTS = 500  # the README's --min-requests
PORTS = range(18190, 18200)


def readme_commands() -> list[list[str]]:
    """The section's shell blocks, each one command (its continuation lines joined)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Try a new version on live traffic") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


def run(argv: list[str], cwd: Path, url: str) -> subprocess.CompletedProcess:
    """A README command, with this checkout's Python for ``.venv/bin/python`` and the test's
    service for the README's address."""
    argv = [sys.executable if a == ".venv/bin/python" else a for a in argv]
    argv = [a.replace("http://127.0.0.1:8000", url) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def top1(model_file: Path, images: np.ndarray) -> np.ndarray:
    """The version's top-1 classes, computed here with onnxruntime and the normalisation its
    metadata states."""
    model = onnx.load(model_file)
    meta = json.loads(next(p.value for p in model.metadata_props if p.key == "vitserve"))
    pre = meta["preprocessing"]
    rows = (images[:, None].astype(np.float32) * pre["scale"] - pre["mean"][0]) / pre["std"][0]
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": rows.astype(np.float32)})
    return logits.argmax(axis=1)


@pytest.fixture(scope="module")
def fashion_test_images() -> np.ndarray:
    from export.data import load_dataset

    _, test = load_dataset("fashion-mnist")
    return test.images[:REQUESTS, 0].numpy().copy()


@pytest.mark.timeout(1800)  # an export of the real model: minutes on a busy 2-core machine
def test_the_readme_trial_works_as_written_on_the_shipped_model(tmp_path, fashion_test_images):
    export, promote = readme_commands()
    assert export[:3] == [".venv/bin/python", "-m", "export.onnx"] and "--candidate" in export
    assert promote[:3] == [".venv/bin/python", "-m", "service.promote"]
    assert promote[promote.index("--min-requests") + 1] == str(MIN_REQUESTS)
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copytree(ROOT / "models" / MODEL, clone / "models" / MODEL)
    (clone / "checkpoints").symlink_to(ROOT / "checkpoints")
    images = fashion_test_images[:REQUESTS]
    settings = {"model_repository": clone / "models", "model_control": "poll"}
    with running_service(tmp_path / "poll.log", ports=PORTS, **settings) as server:
        exported = run(export, clone, server.url)
        assert exported.returncode == 0, exported.stderr[-3000:]
        with httpx.Client(base_url=server.url, timeout=60) as client:
            shadow = f"/models/{MODEL}/shadow"
            wait_until(lambda: client.get(shadow).json()["candidate_ready"], "the candidate ready")
            # the README's promotion asks for 500 compared: traffic goes on until the shadow has
            # compared that many (a copy is shed when the shadow lags, as on a busy machine)
            sent: list[int] = []
            answered = []
            pair: dict = {}
            while pair.get("requests_compared", 0) < MIN_REQUESTS and len(sent) < 3 * REQUESTS:
                for index in range(len(sent), len(sent) + (REQUESTS if not sent else 52)):
                    image = images[index % REQUESTS]
                    response = client.post("/predict", files={"files": ("i.png", png(image))})
                    assert response.status_code == 200, response.text
                    assert response.json()["model"]["version"] == 1  # the candidate answers none
                    answered.append(response.json()["predictions"][0]["index"])
                    sent.append(index % REQUESTS)
                pair = wait_until(
                    lambda: (
                        (p := client.get(shadow).json()["pairs"][0])["requests_compared"]
                        + sum(v for k, v in p["outcomes"].items() if k != "compared")
                        == len(sent)
                        and p
                    ),
                    "every copy settled",
                )
        promoted = run(promote, clone, server.url)
    live, candidate = (top1(clone / "models" / MODEL / v / "model.onnx", images) for v in "12")
    assert answered == live[sent].tolist()
    assert pair["requests_compared"] >= 0.9 * len(sent)
    agreement = (live[sent] == candidate[sent]).mean()
    assert pair["top1_agreement"] == pytest.approx(agreement, abs=0.01)
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert "promoted; live version 1 -> 2" in promoted.stderr
    plan = candidate_plan(read_model_config(clone / "models" / MODEL / "config.pbtxt"))
    assert (plan.live_version, plan.candidate_version) == (2, None)
    with running_service(tmp_path / "again.log", ports=PORTS, **settings) as server:
        response = httpx.post(
            server.url + "/predict", files={"files": ("i.png", png(images[0]))}, timeout=60
        )
    assert response.json()["model"]["version"] == 2  # the decision survived the restart
