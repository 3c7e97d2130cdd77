"""The plain server of plain_onnx_server.py with PyTorch eager instead of onnxruntime: the model built
from the checkpoint the ONNX file was exported from (found by the ``checkpoint_sha256`` of its
metadata), run on one image at a time under ``torch.inference_mode()`` with torch's default threads.

    python -m bench.baselines.torch_eager_server --port 18121 [--model-dir models/fashion-mnist-vit/1]
"""

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

from bench.baselines.plain_onnx_server import main
from export.checkpoint import file_sha256, load_checkpoint
from service.contract.model_repository import CLASSIFIER_FILE, METADATA_KEY

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def checkpoint_of(model_dir: Path, checkpoints: Path = CHECKPOINTS) -> Path:
    """The checkpoint whose sha256 the ONNX file's metadata records."""
    proto = onnx.load(model_dir / CLASSIFIER_FILE, load_external_data=False)
    document = json.loads({p.key: p.value for p in proto.metadata_props}[METADATA_KEY])
    for path in sorted(checkpoints.glob("**/model.safetensors")):
        if file_sha256(path) == document["checkpoint_sha256"]:
            return path
    raise FileNotFoundError(f"no checkpoint under {checkpoints} has the sha256 of {model_dir}")


def torch_model(model_dir: Path) -> Callable[[np.ndarray], np.ndarray]:
    model, _ = load_checkpoint(checkpoint_of(model_dir))

    def run(images: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(images)).numpy()

    return run


if __name__ == "__main__":
    main(torch_model)
