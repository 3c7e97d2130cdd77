"""The server a user would write to serve the shipped model with FastAPI and onnxruntime:
what vitserve must beat (docs/decisions.md#performance-targets).

A sync ``def`` handler (FastAPI runs it in its thread pool), onnxruntime at batch 1 with one intra-op
thread, the same model file, and the service's own preprocessing and metadata reader
(bench/baselines/classifier.py), so that the pixels the model sees are identical. It answers the
service's /predict JSON for base64 images.

    python -m bench.baselines.plain_onnx_server --port 18120 [--model-dir models/fashion-mnist-vit/1]
"""

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.baselines.classifier import MODEL_DIR, Classifier


class Image(BaseModel):
    b64: str


class Predict(BaseModel):
    images: list[Image]
    top_k: int = 5


def create_app(model_dir: Path = MODEL_DIR, model: Callable | None = None) -> FastAPI:
    """The app; ``model`` maps a [1, C, H, W] batch to its logits (onnxruntime when not given)."""
    classifier = Classifier(model_dir, threads=1, model=model)
    app = FastAPI()

    @app.get("/health/ready")
    def ready() -> dict:
        return {"status": "ready"}

    @app.post("/predict")
    def predict(body: Predict) -> dict:
        logits = [classifier.logits(classifier.tensor(i.b64)[None])[0] for i in body.images]
        return classifier.answer(np.asarray(logits), body.top_k)

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
