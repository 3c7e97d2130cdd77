"""The shipped model on mosec (an anchor: docs/decisions.md#performance-targets; pinned in requirements/bench-mosec.txt): mosec's
Rust HTTP front end, ``--decoders`` processes that parse the /predict JSON and decode its base64 images
with vitserve's preprocessing, then ``--infer-workers`` processes (one by default) that run the model
on dynamic batches (bench/baselines/__init__.py) and answer vitserve's /predict JSON
(bench/baselines/classifier.py); with more than one, mosec hands each batch to a free one.
mosec's default JSON (de)serialisation and pickled hand-offs between the stages, as its tutorial
server. Runs in its own venv (bench/baselines/venvs.py); GET / answers 200 once every stage is up.

    .venv-mosec/bin/python -m bench.baselines.mosec_server --port 18116 [--decoders 2] [--infer-workers 2]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from mosec import Server, Worker

from bench.baselines import MAX_BATCH, MAX_WAIT_MS
from bench.baselines.classifier import MODEL_DIR, Classifier, default_threads

ROUTE = "/predict"
ENV_MODEL_DIR, ENV_THREADS = "BENCH_MODEL_DIR", "BENCH_THREADS"  # to the spawned stage workers
REQUEST_TIMEOUT_MS = 30_000


def _classifier(threads: int = 1) -> Classifier:
    return Classifier(Path(os.environ.get(ENV_MODEL_DIR, MODEL_DIR)), threads=threads)


class Decode(Worker):
    """One request's JSON -> its images as the model's input, and its top_k."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = _classifier()

    def forward(self, data: dict) -> dict:
        images = np.stack([self.classifier.tensor(image["b64"]) for image in data["images"]])
        return {"x": images, "top_k": int(data.get("top_k", 5))}


class Infer(Worker):
    """A batch of decoded requests -> one model run -> each request's answer."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = _classifier(int(os.environ.get(ENV_THREADS, "1")))

    def forward(self, data: list[dict]) -> list[dict]:
        return self.classifier.answer_each([(item["x"], item["top_k"]) for item in data])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)  # read by mosec itself too
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--decoders", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--infer-workers", type=int, default=1, help="model processes")
    parser.add_argument("--threads", type=int, default=default_threads(), help="intra-op, each")
    args, _ = parser.parse_known_args()
    env = {ENV_MODEL_DIR: str(args.model_dir), ENV_THREADS: str(args.threads)}
    # mosec answers 408 after 3 s by default; a heavy model's queue at c=64 holds more than that, and
    # vitserve's own config waits 30 s (--timeout on the command line still wins)
    os.environ.setdefault("MOSEC_TIMEOUT", str(REQUEST_TIMEOUT_MS))
    server = Server()
    server.append_worker(Decode, num=args.decoders, env=[env] * args.decoders, route=ROUTE)
    server.append_worker(
        Infer,
        num=args.infer_workers,
        max_batch_size=MAX_BATCH,
        max_wait_time=MAX_WAIT_MS,
        env=[env] * args.infer_workers,
        route=ROUTE,
    )
    server.run()


if __name__ == "__main__":
    main()
