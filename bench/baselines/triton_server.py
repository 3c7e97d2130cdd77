"""The shipped model on Triton Inference Server (an anchor: docs/decisions.md#performance-targets): the ``tritonserver`` that
nvidia-pytriton ships (requirements/bench-triton.txt; C++ HTTP front end and dynamic batcher; its only backend is Python), with
two models, each a Python callable batched by Triton (bench/baselines/__init__.py), ``--instances`` of
it (one by default; pytriton makes a model instance of each callable bound, each here with its own
onnxruntime session, and Triton gives each batch to a free instance):

- ``fashion-mnist-vit``: the Open Inference Protocol on the model's own tensors, FP32 ``images``
  ``[N, 1, 28, 28]`` in, ``logits`` out (what Triton serves for a model repository's ONNX file);
- ``fashion-mnist-vit-png``: one base64 PNG per request as a BYTES ``image`` ``[1, 1]`` (the JSON body
  of TRITON_PNG_BODY), decoded with vitserve's preprocessing (bench/baselines/classifier.py); answers
  ``top_k``, BYTES ``[1, k]`` of ``"<score>:<index>:<label>"`` (Triton's classification format).

Runs in its own venv (numpy<2, bench/baselines/venvs.py); the Python backend's stub links this
interpreter's libpython, so LD_LIBRARY_PATH must hold its LIBDIR (venvs.py sets it). Only HTTP is
served (no gRPC, no metrics port). Ready once GET /v2/models/{name}-png/ready answers 200 (bound last;
/v2/health/ready answers 200 before any model is loaded); stopped by SIGINT or SIGTERM.

    .venv-triton/bin/python -m bench.baselines.triton_server --port 18117 [--instances 2]
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.baselines import MAX_BATCH, MAX_WAIT_MS
from bench.baselines.classifier import MODEL_DIR, Classifier, default_threads

if (
    TYPE_CHECKING
):  # pytriton is in the Triton venv only; the bench imports this module for its names
    from pytriton.triton import Triton

TOP_K = 5
PNG_SUFFIX = "-png"  # the PNG model's name is the model's name with this suffix


def classify_pngs(classifier: Classifier, images: np.ndarray) -> np.ndarray:
    """A batch of BYTES ``[N, 1]`` base64 PNGs -> ``[N, TOP_K]`` of ``"<score>:<index>:<label>"``."""
    logits = classifier.logits(np.stack([classifier.tensor(row[0]) for row in images]))
    top = [
        [f"{e['score']:f}:{e['index']}:{e['label']}".encode() for e in classifier.top_k(r, TOP_K)]
        for r in logits
    ]
    return np.array(top, dtype=np.object_)


def bind(triton: Triton, classifiers: list[Classifier]) -> None:
    """Both models of the module's docstring on ``triton``, an instance of each per classifier."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    meta = classifiers[0].metadata
    shape = (meta.input.channels, meta.input.height, meta.input.width)
    config = ModelConfig(
        max_batch_size=MAX_BATCH,
        batcher=DynamicBatcher(max_queue_delay_microseconds=MAX_WAIT_MS * 1000),
    )

    def tensors(classifier: Classifier) -> Callable:
        @batch
        def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
            return {meta.outputs.logits: classifier.logits(inputs[meta.input.name])}

        return infer

    def pngs(classifier: Classifier) -> Callable:
        @batch
        def infer(image: np.ndarray) -> dict[str, np.ndarray]:
            return {"top_k": classify_pngs(classifier, image)}

        return infer

    triton.bind(
        meta.name,
        [tensors(c) for c in classifiers],
        inputs=[Tensor(name=meta.input.name, dtype=np.float32, shape=shape)],
        outputs=[Tensor(name=meta.outputs.logits, dtype=np.float32, shape=(meta.num_classes,))],
        config=config,
    )
    triton.bind(
        meta.name + PNG_SUFFIX,
        [pngs(c) for c in classifiers],
        inputs=[Tensor(name="image", dtype=bytes, shape=(1,))],
        outputs=[Tensor(name="top_k", dtype=bytes, shape=(TOP_K,))],
        config=config,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--instances", type=int, default=1, help="model instances")
    parser.add_argument("--threads", type=int, default=default_threads(), help="intra-op, each")
    args = parser.parse_args()
    from pytriton.triton import Triton, TritonConfig

    logging.basicConfig(level=logging.WARNING)
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        allow_grpc=False,
        allow_metrics=False,
        log_verbose=0,
    )
    # pytriton stops (and removes its workspace) on SIGINT; the bench stops servers with SIGTERM
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with Triton(config=config) as triton:
            instances = max(1, args.instances)
            bind(triton, [Classifier(args.model_dir, args.threads) for _ in range(instances)])
            triton.serve()
    except KeyboardInterrupt:  # stopped, and its workspace removed
        pass


if __name__ == "__main__":
    main()
