"""The plain server of ``plain_onnx_server`` with the model taken out: every logit 0. What HTTP, JSON,
base64, decoding, preprocessing and the answer cost a FastAPI server here, with no model run at all;
the in-process ceiling is held against this.

    python -m bench.baselines.no_model_server --port 18120 [--model-dir models/fashion-mnist-vit/1]
"""

from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.baselines.plain_onnx_server import main
from service.contract.model_repository import LABELS_FILE


def no_model(model_dir: Path) -> Callable[[np.ndarray], np.ndarray]:
    classes = len((model_dir / LABELS_FILE).read_text().splitlines())
    return lambda images: np.zeros((len(images), classes), np.float32)


if __name__ == "__main__":
    main(no_model)
