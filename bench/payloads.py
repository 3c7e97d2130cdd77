"""The images and request bodies every benchmark sends: Fashion-MNIST test images as 28x28 PNG (or
JPEG) files, in vitserve's /predict JSON, as multipart/form-data file parts, or in the Open Inference
Protocol's JSON.

Read straight from the IDX file Debian's ``dataset-fashion-mnist`` installs (no torch needed); when it
is missing, deterministic synthetic garments of the same size stand in (the report says which).
"""

from __future__ import annotations

import base64
import gzip
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

DATASET_DIRS = (Path("/usr/share/datasets/fashion-mnist"), Path("data/fashion-mnist"))
TEST_IMAGES = "t10k-images-idx3-ubyte.gz"


def load_images(count: int) -> tuple[np.ndarray, str]:
    """``count`` uint8 images [count, 28, 28] and where they came from."""
    for directory in DATASET_DIRS:
        path = directory / TEST_IMAGES
        if path.is_file():
            with gzip.open(path, "rb") as handle:
                raw = handle.read(16 + count * 28 * 28)
            images = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(-1, 28, 28)
            return images[:count].copy(), str(path)
    rng = np.random.default_rng(0)
    images = np.zeros((count, 28, 28), dtype=np.uint8)
    for i in range(count):
        top, left = rng.integers(2, 8, size=2)
        images[i, top : 28 - top, left : 28 - left] = rng.integers(80, 255)
    return images, "synthetic (Fashion-MNIST not found)"


def png_bytes(image: np.ndarray) -> bytes:
    return image_file(image, "PNG")


def image_file(image: np.ndarray, kind: str = "PNG") -> bytes:
    """``image`` as a file of ``kind`` (Pillow's format name: PNG, JPEG, ...)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=kind)
    return buffer.getvalue()


def b64_pngs(count: int) -> tuple[list[str], str]:
    images, source = load_images(count)
    return [base64.b64encode(png_bytes(image)).decode("ascii") for image in images], source


def predict_body(encoded: list[str], top_k: int = 5) -> bytes:
    return json.dumps({"images": [{"b64": e} for e in encoded], "top_k": top_k}).encode()


MULTIPART_BOUNDARY = "vitserve-bench-boundary"


def multipart_body(
    files: list[tuple[str, bytes]], field: str = "files", boundary: str = MULTIPART_BOUNDARY
) -> tuple[bytes, str]:
    """``files`` (name, bytes) as multipart/form-data parts named ``field`` (/predict's and
    ``/models/{name}/predict``'s), and the body's Content-Type."""
    parts = []
    for name, data in files:
        kind = "image/jpeg" if name.lower().endswith((".jpg", ".jpeg")) else "image/png"
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; '
            f'filename="{name}"\r\nContent-Type: {kind}\r\n\r\n'
        )
        parts.append(head.encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def oip_tensor_body(tensors: np.ndarray, input_name: str, output_name: str) -> bytes:
    """The Open Inference Protocol's JSON for the model's own FP32 input ``[N, C, H, W]``, asking
    for ``output_name`` only (what Triton and vitserve's /v2 both answer)."""
    values = [round(float(v), 6) for v in tensors.ravel()]
    tensor = {"name": input_name, "shape": list(tensors.shape), "datatype": "FP32", "data": values}
    return json.dumps({"inputs": [tensor], "outputs": [{"name": output_name}]}).encode()


def oip_png_body(encoded: list[str], input_name: str = "image") -> bytes:
    """The same base64 PNGs as :func:`predict_body`, as a BYTES ``[N, 1]`` Open Inference Protocol
    input (Triton's JSON carries BYTES as strings: the model gets the base64 text)."""
    tensor = {"name": input_name, "shape": [len(encoded), 1], "datatype": "BYTES", "data": encoded}
    return json.dumps({"inputs": [tensor]}).encode()
