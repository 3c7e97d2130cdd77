"""The baseline: what a user following the seed tutorials would deploy.

A FastAPI app that loads the PyTorch model from a checkpoint at start-up and, for every request,
decodes each image with Pillow, converts it to grayscale 28x28, normalises it, and runs the model
eagerly on that one image under ``torch.no_grad()``. A plain ``def`` endpoint, so FastAPI runs it in its
thread pool (FastAPI's advice for blocking code); torch uses its default thread count. No batching, no
onnxruntime. It answers the same JSON API shape as the service's ``/predict`` (b64 images only), so
the same load body works for both.

    # once: the shipped model's weights as a checkpoint (PyTorch built from the ONNX initializers)
    python -m bench.baselines.torch_eager_server --write-checkpoint /tmp/x/model.safetensors
    # then serve it
    python -m bench.baselines.torch_eager_server --checkpoint /tmp/x/model.safetensors --port 18112
"""

import argparse
import base64
import io
import json
import sys
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models" / "fashion-mnist-vit" / "1" / "model.onnx"


class ImageInput(BaseModel):
    b64: str


class PredictRequest(BaseModel):
    images: list[ImageInput]
    top_k: int = 5


def write_checkpoint(onnx_path: Path, out: Path) -> None:
    """The ONNX file's weights as a vitserve safetensors checkpoint, with its labels and normalisation."""
    from bench.weights import torch_from_onnx
    from export.checkpoint import save_checkpoint

    model, metadata = torch_from_onnx(onnx_path)
    save_checkpoint(
        model,
        out,
        metadata.get("dataset") or "unknown",
        tuple(metadata["labels"]),
        name=metadata["name"],
        version=str(metadata["version"]),
        preprocessing=json.dumps(metadata["preprocessing"]),
    )


def create_app(checkpoint: Path):
    import numpy as np
    import torch
    from fastapi import FastAPI
    from PIL import Image

    from export.checkpoint import load_checkpoint

    model, metadata = load_checkpoint(checkpoint)
    labels = json.loads(metadata["labels"])
    preprocessing = json.loads(metadata["preprocessing"])
    mean, std = preprocessing["mean"][0], preprocessing["std"][0]
    size = (model.config.image_width, model.config.image_height)
    name, version = metadata["name"], int(metadata["version"])

    app = FastAPI(title="torch eager baseline")

    @app.get("/health/ready")
    def ready() -> dict:
        return {"status": "ready"}

    @app.post("/predict")
    def predict(request: PredictRequest) -> dict:
        predictions = []
        for item in request.images:
            image = Image.open(io.BytesIO(base64.b64decode(item.b64))).convert("L").resize(size)
            x = torch.tensor(np.array(image), dtype=torch.float32) / 255.0
            x = ((x - mean) / std).unsqueeze(0).unsqueeze(0)
            with torch.no_grad():
                logits = model(x)
            probabilities = torch.softmax(logits, dim=1)[0]
            scores, indices = probabilities.topk(request.top_k)
            top = [
                {"label": labels[i], "index": i, "score": s}
                for s, i in zip(scores.tolist(), indices.tolist(), strict=True)
            ]
            predictions.append({**top[0], "top_k": top})
        return {"model": {"name": name, "version": version}, "predictions": predictions}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.baselines.torch_eager_server", description=__doc__
    )
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint")
    parser.add_argument(
        "--write-checkpoint", type=Path, help="write the ONNX file's weights here and exit"
    )
    parser.add_argument("--onnx", type=Path, default=SHIPPED, help="for --write-checkpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18112)
    args = parser.parse_args(argv)
    if args.write_checkpoint:
        write_checkpoint(args.onnx, args.write_checkpoint)
        return 0
    if not args.checkpoint:
        parser.error("give --checkpoint (or --write-checkpoint)")
    import uvicorn

    uvicorn.run(create_app(args.checkpoint), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
