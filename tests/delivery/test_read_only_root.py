"""The real service (``python -m service``, CPU) runs with a read-only root filesystem.

What the images run under (compose's ``read_only: true`` with a tmpfs ``/tmp``; Kubernetes'
``readOnlyRootFilesystem`` with an ``emptyDir`` on ``/tmp``) is reproduced here without a
container engine: the server starts in a private mount namespace (``unshare -m``) in which the
root mount is remounted read-only (``mount -o remount,bind,ro /``: the working tree, the
virtual environment, the shipped model and ``/tmp`` itself all become read-only), and a fresh
tmpfs is mounted on a directory that ``TMPDIR`` names, the only writable place left besides
``/dev/shm``. chmod alone would prove nothing here: these tests run as root, which writes
through file modes. The mount is private to the server's namespace; nothing outside it changes.

Before it starts the service, the script inside the namespace checks that a file cannot be
created in the working tree, so the test cannot pass on a writable root by mistake. Besides a JSON
/predict, compared with onnxruntime, one multipart upload larger than 1 MiB is sent: Starlette
spools such a part to a temporary file, the one write the service makes, which must land in the
tmpfs.
Skipped, with the reason, where the sandbox does not allow mount namespaces (not root, or
``unshare`` refused).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from bench import server_process
from export.data import get_dataset_spec

pytestmark = pytest.mark.delivery

ROOT = Path(__file__).resolve().parents[2]
PORTS = range(18450, 18500)  # this suite's loopback range
SHIPPED = "fashion-mnist-vit"

# Runs inside the private mount namespace. Exit 97: the root stayed writable (the check failed).
NAMESPACE_SCRIPT = """
set -eu
mount --make-rprivate /
mount -o remount,bind,ro /
if touch "$VITSERVE_TEST_TREE/.read-only-probe" 2>/dev/null; then
    rm -f "$VITSERVE_TEST_TREE/.read-only-probe"
    echo "the working tree is writable: the read-only remount did not take" >&2
    exit 97
fi
mount -t tmpfs -o size=256m,mode=1777 vitserve-tmp "$TMPDIR"
exec "$VITSERVE_TEST_PYTHON" -m service
"""


def mount_namespaces_work() -> str | None:
    """None when a private mount namespace with a read-only remount works here, else why not."""
    if os.geteuid() != 0:
        return "not root: a private mount namespace needs CAP_SYS_ADMIN"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -o remount,bind,ro /"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"this sandbox refuses a private read-only remount: {probe.stderr.strip()}"
    return None


def reference_probabilities(pixels: np.ndarray) -> np.ndarray:
    """The shipped graph run in-process with the training normalisation: what /predict must say."""
    spec = get_dataset_spec("fashion-mnist")
    x = (pixels.astype(np.float32)[None, None] / 255.0 - spec.mean[0]) / spec.std[0]
    session = ort.InferenceSession(
        str(ROOT / "models" / SHIPPED / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (logits,) = session.run(["logits"], {"images": x.astype(np.float32)})
    shifted = np.exp(logits[0] - logits[0].max())
    return shifted / shifted.sum()


def get_json(url: str, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"content-type": "application/json"} if data else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


def test_service_serves_from_a_read_only_root(tmp_path: Path) -> None:
    reason = mount_namespaces_work()
    if reason is not None:
        pytest.skip(reason)
    writable = tmp_path / "tmpfs"
    writable.mkdir()
    port = server_process.free_port(PORTS, start=os.getpid())
    # gRPC on too, as in the image, on another free port of the range (never the default 8001,
    # which anything else on the machine may hold)
    grpc_port = server_process.free_port(PORTS, start=PORTS.index(port) + 1)
    assert grpc_port != port
    env = server_process.clean_env(
        {
            "TMPDIR": str(writable),
            "VITSERVE_TEST_TREE": str(ROOT),
            "VITSERVE_TEST_PYTHON": sys.executable,
            "VITSERVE_HOST": "127.0.0.1",
            "VITSERVE_PORT": str(port),
            "VITSERVE_GRPC_PORT": str(grpc_port),
            "VITSERVE_MODEL_REPOSITORY": "models",  # the shipped repository, as in the image
            "VITSERVE_PROVIDER": "cpu",
            "VITSERVE_INTRA_OP_THREADS": "1",
            "VITSERVE_INTER_OP_THREADS": "1",
            "VITSERVE_LOG_LEVEL": "info",
            "PYTHONDONTWRITEBYTECODE": "1",  # as the Dockerfile sets it
        }
    )
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", NAMESPACE_SCRIPT]
    log = tmp_path / "server.log"
    process = server_process.spawn(argv, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        server_process.wait_ready(process, url, log, timeout_s=90, poll_s=0.1, name="service")
        assert get_json(url + "/health/ready")["ready"] is True
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=10):
            pass  # the gRPC listener is up on the port it was given

        pixels = np.random.default_rng(7).integers(0, 256, (28, 28), dtype=np.uint8)
        answer = get_json(
            url + "/predict",
            {"images": [{"pixels": pixels.tolist()}], "invert": "never", "top_k": 3},
        )
        expected = reference_probabilities(pixels)
        (prediction,) = answer["predictions"]
        assert prediction["index"] == int(np.argmax(expected)), (prediction, expected)
        for entry in prediction["top_k"]:
            assert entry["score"] == pytest.approx(float(expected[entry["index"]]), abs=1e-4)

        noise = np.random.default_rng(8).integers(0, 256, (1100, 1100), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(noise).save(png, format="PNG")
        assert png.tell() > 1024 * 1024, "the part must be large enough to be spooled to disk"
        upload = httpx.post(
            url + "/predict",
            files={"files": ("noise.png", png.getvalue(), "image/png")},
            timeout=60,
        )
        assert upload.status_code == 200, upload.text
        assert len(upload.json()["predictions"]) == 1
    finally:
        server_process.stop_process(process)
    assert not (ROOT / ".read-only-probe").exists()
    assert process.returncode == 0, server_process.log_tail(log)
