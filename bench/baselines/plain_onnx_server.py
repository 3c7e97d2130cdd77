"""The server a user would write to serve the shipped model with FastAPI and onnxruntime (issue 13).

A sync ``def`` handler (FastAPI runs it in its thread pool), onnxruntime at batch 1 with one intra-op
thread, the same model file, and the service's own preprocessing and metadata reader, so that the
pixels the model sees are identical. It answers the service's /predict JSON for base64 images.

    python -m bench.baselines.plain_onnx_server --port 18120 [--model-dir models/fashion-mnist-vit/1]
"""

import argparse
import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from service.contract.model_repository import CLASSIFIER_FILE, parse_metadata
from service.contract.preprocessing import Preprocessor

MODEL_DIR = Path("models/fashion-mnist-vit/1")


class Image(BaseModel):
    b64: str


class Predict(BaseModel):
    images: list[Image]
    top_k: int = 5


def create_app(model_dir: Path = MODEL_DIR, model: Callable | None = None) -> FastAPI:
    """The app; ``model`` maps a [1, C, H, W] batch to its logits (onnxruntime when not given)."""
    path = model_dir / CLASSIFIER_FILE
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    metadata = parse_metadata(session.get_modelmeta().custom_metadata_map, path, "classifier")
    preprocessor = Preprocessor(metadata, 4096 * 4096)
    run = model or (lambda images: session.run(None, {metadata.input.name: images})[0])
    app = FastAPI()

    @app.get("/health/ready")
    def ready() -> dict:
        return {"status": "ready"}

    @app.post("/predict")
    def predict(body: Predict) -> dict:
        predictions = []
        for image in body.images:
            x = preprocessor.from_bytes(base64.b64decode(image.b64), "image").tensor[None]
            logits = np.asarray(run(x)[0], dtype=np.float64)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            top = [
                {"label": metadata.labels[i], "index": int(i), "score": float(p[i])}
                for i in np.argsort(-p, kind="stable")[: body.top_k]
            ]
            predictions.append({**top[0], "top_k": top})
        return {
            "model": {"name": metadata.name, "version": metadata.version},
            "predictions": predictions,
        }

    return app


def main(model: Callable[[Path], Callable] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    args = parser.parse_args()
    app = create_app(args.model_dir, model(args.model_dir) if model else None)
    uvicorn.run(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
