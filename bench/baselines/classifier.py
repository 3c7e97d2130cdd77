"""What every baseline server does with an image, in one place: vitserve's own torch-free preprocessing
and metadata reader (service/), the same model file on onnxruntime, then softmax and top-k answered as
vitserve's /predict answers. The plain, mosec and Triton servers differ only around it.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.contract.model_repository import CLASSIFIER_FILE, parse_metadata
from service.contract.preprocessing import Preprocessor

MODEL_DIR = Path("models/fashion-mnist-vit/1")
MAX_PIXELS = 4096 * 4096


def default_threads() -> int:
    """vitserve's default: every core but one (the one left decodes)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class Classifier:
    """One onnxruntime session of ``model_dir``'s model file, with its metadata's preprocessing.
    ``model`` maps a ``[N, C, H, W]`` batch to its logits (the session when not given)."""

    def __init__(
        self, model_dir: Path = MODEL_DIR, threads: int = 1, model: Callable | None = None
    ):
        path = model_dir / CLASSIFIER_FILE
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.metadata = parse_metadata(
            session.get_modelmeta().custom_metadata_map, path, "classifier"
        )
        self.input_name = self.metadata.input.name
        self.preprocessor = Preprocessor(self.metadata, MAX_PIXELS)
        self.logits = model or (lambda batch: session.run(None, {self.input_name: batch})[0])

    def tensor(self, b64: str | bytes) -> np.ndarray:
        """A base64 image -> the model's float32 ``[C, H, W]`` input, as vitserve makes it."""
        return self.preprocessor.from_bytes(base64.b64decode(b64), "image").tensor

    def top_k(self, logits: np.ndarray, k: int) -> list[dict]:
        """One image's logits -> its ``k`` best classes, best first (ties: lower index)."""
        logits = np.asarray(logits, dtype=np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        return [
            {"label": self.metadata.labels[i], "index": int(i), "score": float(p[i])}
            for i in np.argsort(-p, kind="stable")[:k]
        ]

    def answer(self, logits: np.ndarray, k: int) -> dict:
        """vitserve's /predict JSON for a batch of logits."""
        predictions = []
        for row in logits:
            top = self.top_k(row, k)
            predictions.append({**top[0], "top_k": top})
        return {
            "model": {"name": self.metadata.name, "version": self.metadata.version},
            "predictions": predictions,
        }

    def answer_each(self, requests: list[tuple[np.ndarray, int]]) -> list[dict]:
        """Each request's ``([N, C, H, W] images, top_k)`` -> its answer, from one model run over all
        of their images (a dynamic batch)."""
        logits = self.logits(np.concatenate([images for images, _ in requests]))
        answers, start = [], 0
        for images, k in requests:
            answers.append(self.answer(logits[start : start + len(images)], k))
            start += len(images)
        return answers
