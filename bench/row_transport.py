"""What a 224 x 224 x 3 row costs on its way from a front end to the model: float32 rows against uint8.

``python -m bench.row_transport --model /tmp/heavy/vit-small/1/model.onnx`` times, per row, the steps
that differ between the two ways of sending a row, with the service's own code (``service/link/arena.py``'s
``Arena.put`` and ``ArenaReader.rows``, the batcher's ``np.stack``, ``preprocessing.normalise``):

- float32 (today): the front end normalises the uint8 pixels, writes 602 KB into its arena, and the
  engine stacks the rows it reads in place into the batch;
- uint8: the front end writes 150 KB, and the engine normalises the rows it reads into the batch.

Each step runs ``--batch`` rows at a time, ``--repeats`` times, alternated between the two ways; the
medians per row are set against the model's own time per image at that batch (one intra-op thread).
The reader maps the block a second time in this process, as the engine maps it in its own: the copy
and the page traffic are the same, without the Unix-socket message, which is the same for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.contract.model_repository import Preprocessing
from service.contract.preprocessing import normalise
from service.link.arena import Arena, ArenaReader

SIDE = 224
IMAGENET = Preprocessing(
    color="rgb",
    resize="fit-pad",
    pad_value=0,
    polarity="natural",
    scale=1 / 255,
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
)


def _timed(step: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def model_seconds_per_image(path: Path, batch: int, repeats: int) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    images = np.random.default_rng(0).standard_normal((batch, 3, SIDE, SIDE), dtype=np.float32)
    session.run(None, {"images": images})
    return statistics.median(_timed(lambda: session.run(None, {"images": images}), repeats)) / batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.row_transport", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="a 224 x 224 RGB model.onnx")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--model-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    batch = args.batch
    pixels = np.random.default_rng(1).integers(0, 256, (batch, 3, SIDE, SIDE), dtype=np.uint8)
    name = f"vitserve-bench-rows-{os.getpid()}"
    arena, reader = Arena(name, 64 * 1024 * 1024), ArenaReader()
    try:

        def float32_rows() -> np.ndarray:
            regions = [arena.put(normalise(row, IMAGENET)) for row in pixels]  # front end
            rows = [reader.rows(name, r.offset, (3, SIDE, SIDE), "float32") for r in regions]
            batch_input = np.stack(rows)  # engine: the batcher's gather
            for region in regions:
                arena.free(region)
            return batch_input

        def uint8_rows() -> np.ndarray:
            regions = [arena.put(row) for row in pixels]  # front end
            rows = [reader.rows(name, r.offset, (3, SIDE, SIDE), "uint8") for r in regions]
            batch_input = normalise(np.stack(rows), IMAGENET)  # engine: gather, then normalise
            for region in regions:
                arena.free(region)
            return batch_input

        assert np.array_equal(float32_rows(), uint8_rows())  # the same model input either way
        times: dict[str, list[float]] = {"float32": [], "uint8": []}
        for index in range(args.repeats):
            order = ("float32", "uint8") if index % 2 == 0 else ("uint8", "float32")
            for way in order:
                step = float32_rows if way == "float32" else uint8_rows
                times[way].extend(_timed(step, 1))
        front = {
            "float32": statistics.median(
                _timed(lambda: [arena.free(arena.put(normalise(r, IMAGENET))) for r in pixels], 50)
            ),
            "uint8": statistics.median(
                _timed(lambda: [arena.free(arena.put(r)) for r in pixels], 50)
            ),
        }
    finally:
        reader.close()
        arena.close()
    model = model_seconds_per_image(args.model, batch, args.model_repeats)
    print(f"model {args.model}: {model * 1000:.1f} ms per image at batch {batch}, one thread")
    for way, samples in times.items():
        per_row = statistics.median(samples) / batch
        front_row = front[way] / batch
        print(
            f"{way:>7} rows: {per_row * 1e6:7.0f} us per row front end to batch "
            f"({front_row * 1e6:.0f} us of it in the front end), "
            f"{per_row / model * 100:.2f}% of the model's time per image"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
