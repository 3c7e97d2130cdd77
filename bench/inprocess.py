"""In-process measurements, no HTTP.

- What the model alone costs per image at each batch size on one core (onnxruntime, one intra-op
  thread): how much batching can save in compute.
- The ceiling the service is held against: base64-decode, decode and preprocess the PNG files with the
  service's Preprocessor, stack them and run the model at batch B, in one worker process per core, all
  at once, each with one intra-op thread. The best batch size's images/s is the ceiling.
"""

from __future__ import annotations

import base64
import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.stats import Spread, alternated, rate, spread_text, table
from service.contract.model_repository import CLASSIFIER_FILE, parse_metadata
from service.contract.preprocessing import Preprocessor

BATCHES = (1, 8, 32, 64)


def session(model_dir: Path) -> tuple[ort.InferenceSession, Preprocessor]:
    """onnxruntime with one intra-op thread, and the service's Preprocessor for the model."""
    path = model_dir / CLASSIFIER_FILE
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    model = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    metadata = parse_metadata(model.get_modelmeta().custom_metadata_map, path, "classifier")
    return model, Preprocessor(metadata, 4096 * 4096)


@dataclass(frozen=True)
class ModelCost:
    ms_per_image: dict[str, dict[int, Spread]]  # by model, then batch size

    def markdown(self) -> str:
        models = list(self.ms_per_image)
        batches = sorted({b for costs in self.ms_per_image.values() for b in costs})
        rows = [
            [str(b), *(spread_text(self.ms_per_image[m].get(b), 3) for m in models)]
            for b in batches
        ]
        return "\n".join(
            [
                "## The model alone, one core",
                "",
                "onnxruntime, one intra-op thread, random inputs; milliseconds of compute per image,"
                " each model file measured alternately with the others.",
                "",
                table(["batch", *models], rows),
            ]
        )


def model_cost(
    model_dirs: dict[str, Path], batches: tuple[int, ...], repeats: int, min_time_s: float
) -> ModelCost:
    sessions = {name: session(path) for name, path in model_dirs.items()}
    samples: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in sessions}
    for repeat in range(repeats):
        for name, (model, preprocessor) in sessions.items():
            shape = (preprocessor.channels, preprocessor.height, preprocessor.width)
            input_name = model.get_inputs()[0].name
            for b in alternated(batches, repeat):
                images = np.random.default_rng(b).standard_normal((b, *shape), np.float32)
                per_s = rate(
                    lambda m=model, x=images, n=input_name: m.run(None, {n: x}), b, min_time_s
                )
                samples[name][b].append(1000 / per_s)
    return ModelCost(
        {
            name: {b: Spread.of(values) for b, values in by_batch.items()}
            for name, by_batch in samples.items()
        }
    )


def _worker(connection: Connection, model_dir: Path, encoded: list[str]) -> None:
    model, preprocessor = session(model_dir)
    name = model.get_inputs()[0].name
    connection.send("ready")
    while (task := connection.recv()) is not None:
        batch, start_at, seconds = task
        time.sleep(max(0.0, start_at - time.monotonic()))
        done, began = 0, time.monotonic()
        while time.monotonic() < start_at + seconds:
            chosen = [encoded[(done + i) % len(encoded)] for i in range(batch)]
            files = [base64.b64decode(e, validate=True) for e in chosen]
            images = np.stack([preprocessor.from_bytes(f, "image").tensor for f in files])
            model.run(None, {name: images})
            done += batch
        connection.send(done / (time.monotonic() - began))


class Ceiling:
    """One worker process per core, started once and kept for the whole run."""

    def __init__(self, model_dir: Path, encoded: list[str], processes: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.connections: list[Connection] = []
        self.processes = []
        for _ in range(processes or len(os.sched_getaffinity(0))):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_worker, args=(theirs, model_dir, encoded), daemon=True
            )
            process.start()
            self.connections.append(mine)
            self.processes.append(process)
        for connection in self.connections:
            connection.recv()  # each has loaded the model

    @property
    def pids(self) -> set[int]:
        return {process.pid for process in self.processes}

    def images_per_s(self, batch: int, seconds: float) -> float:
        """Every worker runs batches of ``batch`` for ``seconds``, all at once: their summed rate."""
        start_at = time.monotonic() + 0.2
        for connection in self.connections:
            connection.send((batch, start_at, seconds))
        return sum(connection.recv() for connection in self.connections)

    def close(self) -> None:
        for connection, process in zip(self.connections, self.processes, strict=True):
            connection.send(None)
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
