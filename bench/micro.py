"""In-process measurements behind the service's tuning choices (no HTTP, no torch).

``python -m bench.micro --json OUT [--quick] [--threads N]``

1. onnxruntime session options on the shipped classifier at batch 1, 8 and 32: intra-op threads,
   thread spinning, graph optimisation level, and an offline-optimised model file; images/s and
   session creation time. Also whether a batch size run for the first time costs more than a warm
   one (what the service's warm-up of every batch size buys on the CPU).
2. A two-thread pipeline shaped like the service: one thread decodes and preprocesses PNG files (the
   service's Preprocessor) while another runs onnxruntime on batches of 32 — the same work the
   service overlaps, so thread spinning shows its cost here, not only in an idle benchmark.
3. Decode + preprocess per image (microseconds) for what clients send: a 28x28 PNG, a pixel list, a
   640x480 JPEG photo, a 640x480 PNG photo.
4. Request parsing and response encoding per request (1 and 32 images): pydantic's JSON (what
   FastAPI >= 0.115 does with a response_model), orjson, and json.dumps of jsonable_encoder.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from bench.machine import busy_check
from bench.payloads import b64_pngs, load_images, photo_jpeg, predict_body
from bench.stats import per_call_us, rate, summarize
from service.model_repository import parse_metadata
from service.predictions import prediction
from service.preprocessing import Preprocessor, decode_image, image_to_array
from service.runtime import session_options
from service.schemas import ModelRef, PredictRequest, PredictResponse
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "fashion-mnist-vit" / "1"


def threads_default() -> int:
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The service's defaults, not this shell's VITSERVE_* variables: model_construct reads no environment.
SERVICE_SETTINGS = Settings.model_construct(provider="cpu")


def describe(settings: Settings) -> str:
    threads = settings.intra_op_threads or "auto"
    return f"intra {threads}, spinning {'on' if settings.allow_spinning else 'off'}"


SERVICE_LABEL = f"service: {describe(SERVICE_SETTINGS)}"
OTHER_SPINNING = not SERVICE_SETTINGS.allow_spinning
OTHER_SPINNING_LABEL = f"spinning {'on' if OTHER_SPINNING else 'off'}"


def options(
    intra: int | None = None,
    spinning: bool | None = None,
    level: ort.GraphOptimizationLevel | None = None,
    save_to: Path | None = None,
) -> ort.SessionOptions:
    """The service's session options at its default settings, with at most one thing changed.

    Built by the service's own ``session_options`` so that the baseline is what the service runs.
    """
    changes = {"intra_op_threads": intra, "allow_spinning": spinning}
    settings = SERVICE_SETTINGS.model_copy(
        update={name: value for name, value in changes.items() if value is not None}
    )
    result = session_options(settings)
    if level is not None:
        result.graph_optimization_level = level
    if save_to is not None:
        result.optimized_model_filepath = str(save_to)
    return result


def session_configs(threads: int, offline: Path) -> dict[str, tuple[Path, ort.SessionOptions]]:
    model = SHIPPED / "model.onnx"
    level = ort.GraphOptimizationLevel
    configs = {
        f"{SERVICE_LABEL}, ENABLE_ALL": (model, options()),
        "intra 1": (model, options(intra=1)),
        f"intra {threads}": (model, options(intra=threads)),
        OTHER_SPINNING_LABEL: (model, options(spinning=OTHER_SPINNING)),
        "ENABLE_EXTENDED": (model, options(level=level.ORT_ENABLE_EXTENDED)),
        "ENABLE_BASIC": (model, options(level=level.ORT_ENABLE_BASIC)),
        "DISABLE_ALL": (model, options(level=level.ORT_DISABLE_ALL)),
        "offline-optimised file, loaded with DISABLE_ALL": (
            offline,
            options(level=level.ORT_DISABLE_ALL),
        ),
    }
    if threads == 1:
        del configs["intra 1"]
    return configs


def new_session(path: Path, opts: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def session_options_bench(
    threads: int, batches: list[int], repeats: int, min_time: float, tmp: Path
) -> dict:
    offline = tmp / "model.optimized.onnx"
    new_session(SHIPPED / "model.onnx", options(save_to=offline))
    configs = session_configs(threads, offline)
    sessions, create_ms = {}, {}
    for name, (path, opts) in configs.items():
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            sessions[name] = new_session(path, opts)
            timings.append((time.perf_counter() - started) * 1000)
        create_ms[name] = summarize(timings)
    rng = np.random.default_rng(0)
    inputs = {b: rng.standard_normal((b, 1, 28, 28), dtype=np.float32) for b in batches}
    samples = {name: {b: [] for b in batches} for name in configs}
    for session in sessions.values():
        for b in batches:
            session.run(None, {"images": inputs[b]})
    names = list(configs)
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else list(reversed(names))
        for b in batches:
            for name in order:
                session = sessions[name]
                samples[name][b].append(
                    rate(lambda s=session, x=inputs[b]: s.run(None, {"images": x}), b, min_time)
                )
    result = {}
    for name in names:
        result[name] = {
            "create_ms": create_ms[name],
            "batches": {str(b): summarize(samples[name][b]) for b in batches},
        }
        shown = ", ".join(f"b{b} {result[name]['batches'][str(b)]['median']:,.0f}" for b in batches)
        print(f"  session {name}: {shown} img/s; create {create_ms[name]['median']:.0f} ms")
    result["_offline_file_bytes"] = offline.stat().st_size
    return result


def pipeline_bench(threads: int, repeats: int, seconds: float) -> dict:
    """Images/s through decode+preprocess (one thread) feeding onnxruntime at batch 32 (another)."""
    meta = _metadata()
    preprocessor = Preprocessor(meta, 4096 * 4096)
    encoded, _ = b64_pngs(32)
    files = [base64.b64decode(e) for e in encoded]
    configs = {
        SERVICE_LABEL: options(),
        OTHER_SPINNING_LABEL: options(spinning=OTHER_SPINNING),
        "intra 1": options(intra=1),
    }
    if threads == 1:
        del configs["intra 1"]
    sessions = {n: new_session(SHIPPED / "model.onnx", o) for n, o in configs.items()}
    samples: dict[str, list[float]] = {name: [] for name in configs}

    def run_once(session: ort.InferenceSession) -> float:
        batches: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def produce() -> None:
            while not stop.is_set():
                batch = np.stack([preprocessor.from_bytes(f, "file").tensor for f in files])
                while not stop.is_set():
                    try:
                        batches.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        continue

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        done = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            batch = batches.get()
            session.run(None, {"images": batch})
            done += len(batch)
        elapsed = time.perf_counter() - started
        stop.set()
        producer.join()
        return done / elapsed

    for session in sessions.values():
        session.run(None, {"images": np.zeros((32, 1, 28, 28), np.float32)})
    names = list(configs)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            samples[name].append(run_once(sessions[name]))
    result = {name: summarize(values) for name, values in samples.items()}
    for name, summary in result.items():
        print(f"  pipeline {name}: {summary['median']:,.0f} img/s")
    return result


def first_run_bench(max_batch: int = 32) -> dict:
    """Does a batch size onnxruntime has not seen yet cost more the first time? (What warm-up buys.)

    A fresh session with the service's options runs every batch size 1..max_batch twice; the first
    runs' total is the service's warm-up, the second runs' total what the same work costs warm.
    """
    session = new_session(SHIPPED / "model.onnx", options())
    x = np.random.default_rng(0).standard_normal((max_batch, 1, 28, 28), dtype=np.float32)
    first, second = [], []
    for size in range(1, max_batch + 1):
        for times in (first, second):
            started = time.perf_counter()
            session.run(None, {"images": x[:size]})
            times.append(time.perf_counter() - started)
    result = {
        "sizes": max_batch,
        "first_runs_s": sum(first),
        "second_runs_s": sum(second),
        "first_over_second": sum(first) / sum(second),
        "batch1_first_ms": first[0] * 1000,
        "batch1_second_ms": second[0] * 1000,
    }
    print(
        f"  warm-up: batch sizes 1-{max_batch} first runs {result['first_runs_s']:.3f} s, "
        f"again {result['second_runs_s']:.3f} s"
    )
    return result


def _metadata():
    session = new_session(SHIPPED / "model.onnx", options(intra=1))
    return parse_metadata(
        session.get_modelmeta().custom_metadata_map, SHIPPED / "model.onnx", "classifier"
    )


def preprocessing_bench(repeats: int, min_time: float) -> dict:
    meta = _metadata()
    preprocessor = Preprocessor(meta, 4096 * 4096)
    image = load_images(1)[0][0]
    small_png = io.BytesIO()
    Image.fromarray(image).save(small_png, format="PNG")
    small_png = small_png.getvalue()
    pixels = json.loads(json.dumps(image.tolist()))
    jpeg = photo_jpeg()
    photo = Image.open(io.BytesIO(jpeg)).convert("RGB")
    big_png = io.BytesIO()
    photo.save(big_png, format="PNG")
    big_png = big_png.getvalue()
    array = image_to_array(decode_image(small_png, "f", 4096 * 4096, 28))
    cases = {
        "28x28 PNG: decode + preprocess (from_bytes)": lambda: preprocessor.from_bytes(
            small_png, "f"
        ),
        "28x28 PNG: decode only (decode_image + image_to_array)": lambda: image_to_array(
            decode_image(small_png, "f", 4096 * 4096, 28)
        ),
        "28x28 PNG: preprocess only (from_array)": lambda: preprocessor.from_array(array),
        "28x28 pixel list (from_pixels, after JSON parsing)": lambda: preprocessor.from_pixels(
            pixels, "f"
        ),
        f"640x480 JPEG photo, {len(jpeg) // 1024} KiB (from_bytes, draft decode)": lambda: (
            preprocessor.from_bytes(jpeg, "f")
        ),
        f"640x480 PNG photo, {len(big_png) // 1024} KiB (from_bytes)": lambda: (
            preprocessor.from_bytes(big_png, "f")
        ),
    }
    for run in cases.values():
        run()
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            samples[name].append(per_call_us(run, min_time))
    result = {name: summarize(values) for name, values in samples.items()}
    for name, summary in result.items():
        print(f"  preprocess {name}: {summary['median']:,.1f} us")
    return result


def response_bytes_vectorised(
    logits: np.ndarray, labels: list[str], top_k: int, name: str, version: int
) -> bytes:
    """A proposal for /predict: the whole response in one numpy pass and one orjson call.

    Same numbers as service.predictions (float64 softmax, stable order, ties to the lower index) and
    the same JSON document, without building and re-validating pydantic objects per image.
    """
    import orjson

    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k]
    scores = np.take_along_axis(probabilities, order, axis=1).tolist()
    predictions = []
    for indices, values in zip(order.tolist(), scores, strict=True):
        best = [
            {"label": labels[i], "index": i, "score": v}
            for i, v in zip(indices, values, strict=True)
        ]
        predictions.append({**best[0], "top_k": best})
    return orjson.dumps({"model": {"name": name, "version": version}, "predictions": predictions})


def serialization_bench(repeats: int, min_time: float) -> dict:
    import orjson
    from fastapi.encoders import jsonable_encoder
    from pydantic import TypeAdapter

    meta = _metadata()
    adapter = TypeAdapter(PredictResponse)
    rng = np.random.default_rng(0)
    result = {}
    for count in (1, 32):
        encoded, _ = b64_pngs(count)
        body = predict_body(encoded)
        logits = rng.standard_normal((count, len(meta.labels))).astype(np.float32)

        def build(logits=logits):
            return PredictResponse(
                model=ModelRef(name=meta.name, version=meta.version),
                predictions=[prediction(row, meta.labels, 5) for row in logits],
            )

        def service_path(logits=logits):
            return adapter.dump_json(build(logits))

        def proposal(logits=logits):
            return response_bytes_vectorised(logits, meta.labels, 5, meta.name, meta.version)

        response = build()
        if json.loads(proposal()) != json.loads(service_path()):
            raise RuntimeError("the proposed response encoding differs from the service's")
        cases = {
            "parse request (PredictRequest.model_validate_json)": lambda body=body: (
                PredictRequest.model_validate_json(body)
            ),
            "base64-decode the images": lambda encoded=encoded: [
                base64.b64decode(e, validate=True) for e in encoded
            ],
            "response, service path (prediction() per image + pydantic dump_json)": service_path,
            "response, proposal (one numpy pass + orjson, no pydantic objects)": proposal,
            "encode only: pydantic dump_json (FastAPI's response_model path)": lambda r=response: (
                adapter.dump_json(r)
            ),
            "encode only: orjson.dumps(model_dump())": lambda r=response: orjson.dumps(
                r.model_dump()
            ),
            "encode only: json.dumps(jsonable_encoder())": lambda r=response: json.dumps(
                jsonable_encoder(r)
            ),
        }
        for run in cases.values():
            run()
        samples = {name: [] for name in cases}
        for _ in range(repeats):
            for name, run in cases.items():
                samples[name].append(per_call_us(run, min_time))
        for name in cases:
            key = f"{count} image(s): {name}"
            result[key] = summarize(samples[name])
            print(f"  request {key}: {result[key]['median']:,.1f} us")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=threads_default())
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else 3
    min_time = 0.05 if args.quick else 0.4
    batches = [1, 32] if args.quick else [1, 8, 32]
    started = time.perf_counter()
    print(f"micro: {repeats} repeats, >= {min_time} s per point", flush=True)
    results: dict = {"threads": args.threads, "repeats": repeats, "min_time_s": min_time}
    results["busy_checks"] = [busy_check().to_dict()]
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-") as tmp:
        results["session_options"] = session_options_bench(
            args.threads, batches, repeats, min_time, Path(tmp)
        )
    results["first_run"] = first_run_bench()
    results["pipeline"] = pipeline_bench(args.threads, repeats, 0.5 if args.quick else 2.0)
    results["preprocessing_us"] = preprocessing_bench(repeats, min_time)
    results["request_us"] = serialization_bench(repeats, min_time)
    results["busy_checks"].append(busy_check().to_dict())
    results["busy"] = any(check["busy"] for check in results["busy_checks"])
    results["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"micro: done in {results['seconds']:.0f} s -> {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
