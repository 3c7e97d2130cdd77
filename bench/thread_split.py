"""The onnxruntime thread split for a heavy model, measured under the service.

``python -m bench.thread_split --repo /tmp/heavy --model vit-small`` serves the model with each split of
(intra-op threads per session, classifier instances) in turn, alternating the order between rounds, and
loads each with ``hey`` at ``--concurrency`` clients posting one 640 x 480 JPEG to ``/predict`` for
``--seconds``: images/s, p50 and p99 per split, and their medians over the rounds.
``python -m bench.heavy_models small --repo /tmp/heavy`` writes the model. The JPEG is drawn here (a
photo-like gradient, shapes and grain at quality 90), since nothing may be downloaded.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from bench import hey, server_process
from bench.payloads import predict_body

PORTS = range(18150, 18160)
SPLITS = (
    (1, 2),
    (2, 1),
    (1, 1),
    (2, 2),
)  # (intra-op threads, instances); the first: today's default


def photo_jpeg(width: int = 640, height: int = 480, seed: int = 0) -> bytes:
    """A photo-sized JPEG with a photo's kind of content: smooth light, edges and sensor grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 180 + 40, y / height * 160 + 50, (x + y) / (width + height) * 200])
    pixels = np.clip(base.transpose(1, 2, 0) + rng.normal(0, 12, (height, width, 3)), 0, 255)
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width - 80)), int(rng.integers(0, height - 80))
        size = int(rng.integers(30, 200))
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        draw.ellipse((x0, y0, x0 + size, y0 + size * 3 // 4), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def measure_split(
    repo: Path, model: str, intra: int, instances: int, body: Path, concurrency: int, seconds: float
) -> hey.HeyResult:
    log = Path(tempfile.mkdtemp(prefix="thread-split-")) / "service.log"
    with server_process.running_service(
        log,
        ports=PORTS,
        model_repository=repo,
        models=model,
        intra_op_threads=intra,
        instance_count=instances,
        request_timeout_s=120,
    ) as server:
        url = f"{server.url}/predict"
        hey.run(hey.command(url, body, concurrency=concurrency, requests=concurrency), 300)
        return hey.run(
            hey.command(url, body, concurrency=concurrency, duration_s=seconds, timeout_s=120),
            seconds + 180,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.thread_split", description=__doc__)
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--model", default="vit-small")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    body = Path(tempfile.mkdtemp(prefix="thread-split-")) / "photo.json"
    body.write_bytes(predict_body([base64.b64encode(photo_jpeg()).decode()]))
    results: dict[tuple[int, int], list[hey.HeyResult]] = {split: [] for split in SPLITS}
    for round_index in range(args.rounds):
        order = SPLITS if round_index % 2 == 0 else tuple(reversed(SPLITS))
        for intra, instances in order:
            started = time.perf_counter()
            result = measure_split(
                args.repo, args.model, intra, instances, body, args.concurrency, args.seconds
            )
            results[(intra, instances)].append(result)
            print(
                f"round {round_index + 1} intra_op {intra} instances {instances}: "
                f"{result.ok_rps:.2f} images/s, p50 {_ms(result, 50)}, p99 {_ms(result, 99)}, "
                f"statuses {result.status_codes}, errors {result.errors} "
                f"({time.perf_counter() - started:.0f} s with start-up)",
                flush=True,
            )
    print(f"\nmedians over {args.rounds} rounds, c={args.concurrency}, {args.seconds:g} s each:")
    for (intra, instances), runs in results.items():
        rps = statistics.median(r.ok_rps for r in runs)
        p50 = statistics.median(r.ms(50) or float("nan") for r in runs)
        p99 = statistics.median(r.ms(99) or float("nan") for r in runs)
        print(
            f"intra_op {intra} x {instances} instances: {rps:.2f} images/s, p50 {p50:.0f} ms, "
            f"p99 {p99:.0f} ms"
        )


def _ms(result: hey.HeyResult, percentile: int) -> str:
    value = result.ms(percentile)
    return "-" if value is None else f"{value:.0f} ms"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
