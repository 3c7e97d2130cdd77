"""An int8 variant of ViT-S/16 tried on live JPEG traffic through the shadow, promoted as a user
promotes it, then served against the float version it replaced.

    python -m bench.int8_trial [--size small] [--compare 200] [--seconds 12] [--repeats 2]

The steps, as a user takes them with a model of their own:

1. Version 1: ViT-S/16 with seeded random weights (bench/graphs.py's ``random_weight_model``: the
   head drawn, so that the logits are not all zero; bench/heavy_models.py writes it with a DeiT's
   resize-crop preprocessing). Version 2: its classifier through onnxruntime's dynamic int8
   quantization as the export makes it (export/quantize.py's ``quantize_graph(..., "dynamic")``:
   7-bit weights, ``WEIGHT_RANGE``, which an AVX2 CPU without VNNI sums without saturating; with
   8-bit weights this model's offline agreement fell from 94% to 72% there), written as the candidate
   of version 1 (export/repository.py's ``write_version(..., candidate=True)``, what ``python -m
   export.onnx ... --candidate`` does), with its offline agreement against the float graph on the
   first ``--offline`` trial photos in its metadata (export/quantize.py's ``agreement``).
2. vitserve serves both (``VITSERVE_WORKERS`` = the cores): version 1 answers, version 2 shadows every
   request. Distinct 640 x 480 JPEGs (seeded crops of the sample photos, bench/decode.py), one per
   request, one at a time (the shadow runs its copies while the instances are idle), until
   ``--compare`` requests were compared; the shadow's report (``GET /models/NAME/shadow``) is printed.
3. ``python -m service.promote`` with ``--min-agreement`` (0.97, README's), ``--min-requests``
   ``--compare`` and ``--max-latency-ratio`` (1.0: an int8 variant is tried for speed), first with
   ``--dry-run``. Random weights give near-uniform probabilities, so the int8 graph's top-1 can
   differ on a few percent of photos (97% offline agreement measured), near the threshold: where
   that alone refuses it, the step says so and promotes with ``--min-agreement
   --accept-agreement`` (0.5), the flag a user passes to accept it.
4. Served images/s and latency at ``--concurrency`` (16) with one 640 x 480 JPEG per request:
   ``/models/NAME/versions/2/predict`` (int8, live) against ``.../versions/1/predict`` (float, still
   loaded: the trial's version policy keeps both), on the same server, ``hey`` for ``--seconds``,
   alternated within each of ``--repeats`` repeats (which goes first alternates too); medians. With
   each window, the CPU time the server's engine and front ends used per image answered (/proc):
   int8 shrinks the engine's, and the front end's decoding and resizing stays what it was; and the
   images a classifier batch held (``vitserve_batch_size``), which sets the model's cost per image.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
from PIL import Image

from bench import hey
from bench.compare import batch_counters
from bench.contenders import cores
from bench.decode import QUALITY, sample_photos
from bench.graphs import random_weight_model
from bench.heavy_models import write_heavy_model
from bench.int8_trial_report import (
    ARMS,
    FLOAT,
    INT8,
    Promotion,
    Trial,
    Window,
    shadow_pair,
    shown,
)
from bench.machine import busy_check, descendants
from bench.payloads import predict_body
from bench.real_size import cpu_by_role, metadata_document, tree_stat, write_variant
from bench.real_size_report import PHOTO_SIZE
from bench.server_process import REPO, RunningServer, http_get, running_service
from bench.stats import fmt
from export.onnx_graphs import session_for
from export.quantize import WEIGHT_RANGE, agreement, quantize_graph
from service.contract.candidates import Thresholds, judge
from service.contract.model_repository import CLASSIFIER_FILE, ModelMetadata
from service.contract.preprocessing import Preprocessor

PORTS = range(18200, 18210)  # no other bench's
PROMOTE = (sys.executable, "-m", "service.promote")
EXIT_PROMOTED = 0  # service/promote.py's exit codes
RANDOM_WEIGHTS_AGREEMENT = 0.5


def crop_boxes(
    height: int, width: int, count: int, rng: np.random.Generator, aspect: float = 4 / 3
) -> list[tuple[int, int, int, int]]:
    """``count`` boxes ``(left, top, right, bottom)`` of ``aspect`` (width / height) inside a
    ``height`` x ``width`` image, each 50-100% of the largest such box's side, placed at random."""
    largest_w = min(width, int(height * aspect))
    boxes = []
    for _ in range(count):
        w = max(1, int(largest_w * rng.uniform(0.5, 1.0)))
        h = max(1, min(height, round(w / aspect)))
        left = int(rng.integers(0, width - w + 1))
        top = int(rng.integers(0, height - h + 1))
        boxes.append((left, top, left + w, top + h))
    return boxes


def trial_photos(
    photos: dict[str, np.ndarray], count: int, seed: int = 0, size: tuple[int, int] = PHOTO_SIZE
) -> list[bytes]:
    """``count`` distinct JPEGs of ``size``: seeded 4:3 crops of ``photos`` in turn, each mirrored
    or not, resized (bicubic), quality 90."""
    rng = np.random.default_rng(seed)
    arrays = list(photos.values())
    per_photo = -(-count // len(arrays))
    boxes = [crop_boxes(*a.shape[:2], per_photo, rng) for a in arrays]
    found = []
    for index in range(count):
        photo, box = arrays[index % len(arrays)], boxes[index % len(arrays)][index // len(arrays)]
        image = Image.fromarray(photo).crop(box).resize(size, Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=QUALITY)
        found.append(buffer.getvalue())
    return found


def offline_agreement(float_dir: Path, int8: onnx.ModelProto, jpegs: list[bytes]) -> dict:
    """export/quantize.py's ``agreement`` of the int8 graph against ``float_dir``'s on ``jpegs``,
    preprocessed as the model's metadata says."""
    metadata = ModelMetadata.model_validate(metadata_document(float_dir))
    preprocessor = Preprocessor(metadata, 4096 * 4096)
    images = np.stack([preprocessor.from_bytes(jpeg, "image").tensor for jpeg in jpegs])
    float_graph = onnx.load(float_dir / CLASSIFIER_FILE)
    logits = [
        np.concatenate(
            [session.run(None, {"images": images[i : i + 8]})[0] for i in range(0, len(images), 8)]
        )
        for session in (session_for(float_graph), session_for(int8))
    ]
    return {**agreement(*logits), "images": len(jpegs)}


def write_trial(
    size: str, repo: Path, jpegs: list[bytes], seed: int = 0
) -> tuple[Path, Path, dict]:
    """Version 1 (float) and version 2 (its dynamic int8, the candidate) in ``repo``."""
    model = random_weight_model(size, seed)
    float_dir = write_heavy_model(size, repo, seed=seed, geometry="resize-crop", model=model)
    int8 = quantize_graph(onnx.load(float_dir / CLASSIFIER_FILE), "dynamic")
    offline = offline_agreement(float_dir, int8, jpegs)
    int8_dir = write_variant(
        int8,
        float_dir,
        repo,
        INT8,
        candidate=True,
        precision="int8",
        quantization="dynamic",
        weight_range=list(WEIGHT_RANGE),
        float_agreement=offline,
    )
    return float_dir, int8_dir, offline


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return json.load(answer)


def jpeg_body(jpeg: bytes) -> bytes:
    return predict_body([base64.b64encode(jpeg).decode("ascii")])


def post(url: str, body: bytes) -> tuple[int, bytes]:
    """The status and body of a /predict answer."""
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def until_compared(
    server: RunningServer, name: str, jpegs: list[bytes], wanted: int, clients: int = 1
) -> tuple[dict, int, int]:
    """Send ``jpegs`` in turn (``clients`` at a time) until ``wanted`` requests were compared or
    every JPEG was sent three times; the last report, the requests sent and those not answered 200."""
    shadow = f"{server.url}/models/{name}/shadow"
    url = f"{server.url}/models/{name}/predict"
    sent = failed = 0
    report = get_json(shadow)
    with ThreadPoolExecutor(clients) as pool:
        for start in range(0, 3 * len(jpegs), 8 * clients):
            chunk = [jpegs[i % len(jpegs)] for i in range(start, start + 8 * clients)]
            statuses = [code for code, _ in pool.map(lambda j: post(url, jpeg_body(j)), chunk)]
            sent += len(statuses)
            failed += sum(status != 200 for status in statuses)
            time.sleep(0.2)  # the copies still queued run
            report = get_json(shadow)
            if shadow_pair(report).get("requests_compared", 0) >= wanted:
                break
    return report, sent, failed


def compact(report: dict) -> dict:
    """``report`` with each pair's confusion (a row per live class -> candidate class) summed up."""
    pairs = []
    for pair in report.get("pairs", []):
        rows = pair.get("confusion", [])
        moved = sum(r["images"] for r in rows if r["live_class"] != r["candidate_class"])
        summary = f"{len(rows)} live -> candidate classes; {moved} images changed class"
        pairs.append({**pair, "confusion": summary})
    return {**report, "pairs": pairs}


def promote_argv(
    url: str, name: str, agreement: float, requests: int, latency: float, dry_run: bool
) -> list[str]:
    return [
        *PROMOTE,
        *("--url", url, "--model", name),
        *("--min-agreement", f"{agreement:g}", "--min-requests", str(requests)),
        *("--max-latency-ratio", f"{latency:g}"),
        *(["--dry-run"] if dry_run else []),
    ]


def promote(argv: list[str]) -> Promotion:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=700)
    return Promotion(argv, done.returncode, (done.stdout + done.stderr).strip())


def refused_on_agreement_only(report: dict, thresholds: Thresholds) -> bool:
    """Whether ``report`` misses ``thresholds`` on top-1 agreement and nothing else (the verdict
    service.promote reaches: service/contract/candidates.py's ``judge``)."""
    verdict = judge(report, thresholds)
    missed = verdict.reasons
    return verdict.action == "rollback" and all(r.startswith("top-1 agreement") for r in missed)


def window(
    server: RunningServer, version: int, repeat: int, argv: list[str], seconds: float
) -> Window:
    own = {server.process.pid, *descendants(server.process.pid)}
    check = busy_check(own, interval_s=0.5)
    before = tree_stat(server.process.pid)
    batches_before = batch_counters(http_get(f"{server.url}/metrics"))
    result = hey.run(argv, seconds + 120)
    cpu = cpu_by_role("vitserve", before, tree_stat(server.process.pid))
    images, batches = map(
        float.__sub__, batch_counters(http_get(f"{server.url}/metrics")), batches_before
    )
    per_image = {r: 1000 * s / result.ok for r, s in cpu.items()} if result.ok else {}
    return Window(
        version,
        repeat,
        result.ok_rps,
        result.ms(50),
        result.ms(99),
        result.not_ok + result.error_count,
        check.other_cores,
        per_image,
        images / batches if batches else None,
    )


def run(args: argparse.Namespace, out: Path, command: str) -> Trial:
    out.mkdir(parents=True, exist_ok=True)
    jpegs = trial_photos(sample_photos(), max(args.compare, args.offline), args.seed)
    print(f"writing version 1 and its int8 candidate ({len(jpegs)} trial photos) ...", flush=True)
    float_dir, _, offline = write_trial(args.size, out / "models", jpegs[: args.offline], args.seed)
    name = float_dir.parent.name
    print(f"offline agreement: {json.dumps(offline)}", flush=True)
    body = out / "body-photo.json"
    body.write_bytes(jpeg_body(jpegs[0]))
    with running_service(
        out / "vitserve.log", ports=PORTS, model_repository=out / "models", workers=cores()
    ) as server:
        report, sent, failed = until_compared(server, name, jpegs, args.compare)
        (out / "shadow-report.json").write_text(json.dumps(report, indent=1))
        print(
            "the shadow's report (GET /models/NAME/shadow; whole in shadow-report.json):",
            json.dumps(compact(report), indent=1),
            sep="\n",
            flush=True,
        )
        thresholds = Thresholds(args.min_agreement, args.compare, args.max_latency_ratio, None)
        asked = (thresholds.min_agreement, args.compare, args.max_latency_ratio)
        promotions = [promote(promote_argv(server.url, name, *asked, dry_run=True))]
        if promotions[0].code == EXIT_PROMOTED:
            promotions.append(promote(promote_argv(server.url, name, *asked, dry_run=False)))
        elif refused_on_agreement_only(get_json(f"{server.url}/models/{name}/shadow"), thresholds):
            accepted = (args.accept_agreement, *asked[1:])
            promotions.append(promote(promote_argv(server.url, name, *accepted, dry_run=False)))
        for promotion in promotions:
            print(f"$ {shown(promotion.argv)}  # exit {promotion.code}", promotion.log, sep="\n")
        code, answer = post(f"{server.url}/models/{name}/predict", body.read_bytes())
        live_after = json.loads(answer)["model"]["version"] if code == 200 else None
        trial = Trial(args.size, offline, report, sent, failed, promotions, live_after)
        trial.concurrency, trial.seconds, trial.command = args.concurrency, args.seconds, command
        urls = {v: f"{server.url}/models/{name}/versions/{v}/predict" for v in (FLOAT, INT8)}
        for url in urls.values():  # warm: each version's first runs at this load
            hey.run(
                hey.command(url, body, concurrency=args.concurrency, requests=32, timeout_s=120),
                300,
            )
        for repeat in range(args.repeats):
            order = (FLOAT, INT8) if repeat % 2 == 0 else (INT8, FLOAT)
            for version in order:
                argv = hey.command(
                    urls[version],
                    body,
                    concurrency=args.concurrency,
                    duration_s=args.seconds,
                    timeout_s=120,
                )
                got = window(server, version, repeat, argv, args.seconds)
                trial.windows.append(got)
                print(
                    f"  r{repeat} {ARMS[version]}: {got.images_s:.1f} images/s p50 "
                    f"{fmt(got.p50_ms)} p99 {fmt(got.p99_ms)} failed {got.failed} "
                    f"others {got.other_cores:.2f} cores cpu ms {got.cpu_ms} batch {fmt(got.batch, 1)}",
                    flush=True,
                )
    return trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_trial", description=__doc__)
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--compare", type=int, default=200, help="requests the shadow compares")
    parser.add_argument("--offline", type=int, default=64, help="photos of the offline agreement")
    parser.add_argument("--min-agreement", type=float, default=0.97)
    parser.add_argument("--accept-agreement", type=float, default=RANDOM_WEIGHTS_AGREEMENT)
    parser.add_argument("--max-latency-ratio", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="raw results (default: a temporary directory)")
    args = parser.parse_args(argv)
    if min(args.compare, args.offline, args.concurrency, args.repeats) < 1 or args.seconds <= 0:
        parser.error("--compare, --offline, --concurrency, --repeats and --seconds must be above 0")
    out = args.out or Path(tempfile.mkdtemp(prefix="int8-trial-"))
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m bench.int8_trial", *([shlex.join(given)] if given else [])])
    trial = run(args, out, command)
    print(trial.markdown())
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
