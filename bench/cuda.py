"""``python -m bench.cuda``: the service on an NVIDIA GPU, checked against the CPU, then measured.

Run it on a machine with a CUDA GPU, onnxruntime-gpu (requirements/serve-gpu.txt) and hey:

    python -m bench.cuda --output cuda.md [--hey-threads 4] [--seconds 5]

1. Each model file on onnxruntime's CUDA provider against its CPU provider, on the Fashion-MNIST test
   images (synthetic garments when the dataset is missing): relative error of the outputs, top-1
   agreement and accuracy; then milliseconds per batch on each provider.
2. ``python -m service`` with ``VITSERVE_PROVIDER=cuda``: it reports the CUDA provider, and /predict,
   /v2 infer and /attention answer what the CPU provider computes for the same images.
3. Load: hey at each concurrency against vitserve on CUDA (``VITSERVE_WORKERS`` 1, 4 and the cores),
   vitserve on the CPU (the cores) and the plain server (onnxruntime on the CPU, batch 1), one server
   at a time, with the cores each one's processes used.

Prints the report (Markdown) and exits 1 when a check of parts 1-2 fails. hey runs with
``GOMAXPROCS=--hey-threads``: on a many-core machine one thread would be the bottleneck.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import hey
from bench.baselines.classifier import Classifier
from bench.compare import batch_counters
from bench.contenders import cores
from bench.machine import CLOCK_TICKS, cores_used, descendants, process_tree, thread_ticks
from bench.payloads import DATASET_DIRS, load_images, oip_tensor_body, png_bytes, predict_body
from bench.profile import parse_raw, py_spy
from bench.server_process import REPO, SERVICE, clean_env, http_get, running, service_env
from bench.stats import rate, table
from service.contract.model_repository import ATTENTION_FILE, CLASSIFIER_FILE, parse_metadata
from service.contract.preprocessing import Preprocessor

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
# what parts 1 and 2 check against the CPU: the provider, and the VITSERVE_PROVIDER that picks it
# (tests/bench/test_cuda.py runs the checks with the CPU standing in for the GPU)
DEVICE, DEVICE_SETTING = CUDA, "cuda"
MODELS = REPO / "models"
DEFAULT = MODELS / "fashion-mnist-vit" / "1"
PORTS = range(18100, 18110)  # the benches' range, no other bench's part
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
# float32 on two providers: cuDNN and MLAS sum in other orders (and CUDA may use TF32 matmuls)
MAX_RELATIVE_ERROR = {"fp32": 1e-2, "int8": 5e-2}
MIN_AGREEMENT = 0.995
MAX_SCORE_DIFFERENCE = 1e-2  # softmax probability, service on CUDA against the CPU provider
BATCHES = (1, 8, 64, 512)
LEVELS = (1, 64, 256)


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"--setting {text!r}: expected name=value")
    return key.strip().lower(), value.strip()


def labels(count: int) -> np.ndarray | None:
    import gzip

    for directory in DATASET_DIRS:
        path = directory / TEST_LABELS
        if path.is_file():
            with gzip.open(path, "rb") as handle:
                return np.frombuffer(handle.read(), np.uint8, offset=8)[:count].astype(np.int64)
    return None


def sessions(path: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    cpu = ort.InferenceSession(path, providers=[CPU])
    cuda = ort.InferenceSession(path, providers=[DEVICE, CPU] if DEVICE != CPU else [CPU])
    if cuda.get_providers()[0] != DEVICE:
        raise RuntimeError(f"{path}: onnxruntime fell back to {cuda.get_providers()[0]}")
    return cpu, cuda


def run_all(
    session: ort.InferenceSession, inputs: np.ndarray, chunk: int = 500
) -> list[np.ndarray]:
    name = session.get_inputs()[0].name
    parts = [session.run(None, {name: inputs[i : i + chunk]}) for i in range(0, len(inputs), chunk)]
    return [np.concatenate(outputs) for outputs in zip(*parts, strict=True)]


def relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    return float(np.linalg.norm(got - reference) / np.linalg.norm(reference))


@dataclass
class Report:
    lines: list[str]
    failures: list[str]

    def check(self, ok: bool, what: str) -> str:
        if not ok:
            self.failures.append(what)
        return "pass" if ok else "**FAIL**"


def check_models(report: Report, images: np.ndarray, truth: np.ndarray | None) -> np.ndarray:
    """Part 1; returns the default model's inputs for the later parts."""
    rows, speed, default_inputs = [], [], None
    for model_dir in sorted(
        d / "1" for d in MODELS.iterdir() if (d / "1" / CLASSIFIER_FILE).is_file()
    ):
        path = model_dir / CLASSIFIER_FILE
        cpu, cuda = sessions(path)
        meta = parse_metadata(cpu.get_modelmeta().custom_metadata_map, path, "classifier")
        pre = Preprocessor(meta, 4096 * 4096)
        inputs = np.stack([pre.from_array(i[:, :, None].astype(np.float32)).tensor for i in images])
        default_inputs = inputs if model_dir == DEFAULT else default_inputs
        (on_cpu,), (on_cuda,) = run_all(cpu, inputs), run_all(cuda, inputs)
        error = relative_error(on_cuda, on_cpu)
        agree = float(np.mean(on_cuda.argmax(1) == on_cpu.argmax(1)))
        accuracy = (
            ""
            if truth is None
            else (
                f"{np.mean(on_cuda.argmax(1) == truth):.4f} / {np.mean(on_cpu.argmax(1) == truth):.4f}"
            )
        )
        limit = MAX_RELATIVE_ERROR.get(meta.precision or "fp32", 1e-2)
        verdict = report.check(error < limit and agree >= MIN_AGREEMENT, f"{path} on CUDA")
        rows.append(
            [
                str(path.relative_to(REPO)),
                f"{error:.2e} (< {limit:g})",
                f"{agree:.4f}",
                accuracy,
                str(meta.test_accuracy),
                verdict,
            ]
        )
        if (model_dir / ATTENTION_FILE).is_file():
            apath = model_dir / ATTENTION_FILE
            acpu, acuda = sessions(apath)
            errors = [
                relative_error(g, r)
                for g, r in zip(
                    run_all(acuda, inputs[:1000]), run_all(acpu, inputs[:1000]), strict=True
                )
            ]
            verdict = report.check(max(errors) < limit, f"{apath} on CUDA")
            rows.append(
                [
                    str(apath.relative_to(REPO)),
                    "outputs: " + ", ".join(f"{e:.2e}" for e in errors),
                    "",
                    "",
                    "",
                    verdict,
                ]
            )
        name = cpu.get_inputs()[0].name
        for batch in BATCHES:
            x = inputs[np.arange(batch) % len(inputs)]
            ms = [
                1000 / rate(lambda s=s, n=name, x=x: s.run(None, {n: x}), 1, 0.3)
                for s in (cuda, cpu)
            ]
            speed.append(
                [
                    model_dir.parent.name,
                    str(batch),
                    f"{ms[0]:.3f}",
                    f"{ms[1]:.3f}",
                    f"{batch * 1000 / ms[0]:,.0f}",
                    f"{batch * 1000 / ms[1]:,.0f}",
                ]
            )
    report.lines += [
        "## 1. The model files: CUDA against onnxruntime's CPU provider",
        "",
        f"{len(images):,} test images; relative error ‖cuda - cpu‖ / ‖cpu‖ of the logits; accuracy "
        "CUDA / CPU; the accuracy the export recorded in the file's metadata.",
        "",
        table(["file", "relative error", "top-1 agreement", "accuracy", "metadata", "check"], rows),
        "",
        "Milliseconds per batch (onnxruntime defaults: every core for the CPU provider):",
        "",
        table(["model", "batch", "CUDA ms", "CPU ms", "CUDA images/s", "CPU images/s"], speed),
        "",
    ]
    return default_inputs


def _post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def check_service(report: Report, out: Path, images: np.ndarray) -> None:
    """Part 2: vitserve on CUDA answers what the CPU provider computes."""
    encoded = [base64.b64encode(png_bytes(i)).decode("ascii") for i in images[:32]]
    reference = Classifier(DEFAULT)
    logits = reference.logits(np.stack([reference.tensor(e) for e in encoded]))
    name, meta = DEFAULT.parent.name, reference.metadata
    settings = {"model_repository": MODELS, "provider": DEVICE_SETTING, "workers": 2}
    rows = []
    with running(
        SERVICE,
        lambda port: service_env(port, **settings),
        out / "cuda-check.log",
        ports=PORTS,
        name="vitserve on CUDA",
    ) as live:
        info = json.loads(urllib.request.urlopen(f"{live.url}/models/{name}", timeout=10).read())
        rows.append(
            [
                "provider reported",
                info.get("provider"),
                report.check(info.get("provider") == DEVICE, "provider reported"),
            ]
        )
        answer = _post(live.url + "/predict", predict_body(encoded, top_k=10))["predictions"]
        worst, same = 0.0, True
        for got, row in zip(answer, logits, strict=True):
            expected = {c["index"]: c["score"] for c in reference.top_k(row, 10)}
            same &= got["index"] == reference.top_k(row, 1)[0]["index"]
            worst = max(worst, *(abs(c["score"] - expected[c["index"]]) for c in got["top_k"]))
        rows.append(
            [
                f"/predict, {len(encoded)} PNGs: largest score difference, same top-1",
                f"{worst:.2e}, {same}",
                report.check(worst < MAX_SCORE_DIFFERENCE and same, "/predict on CUDA"),
            ]
        )
        tensors = np.stack([reference.tensor(e) for e in encoded])
        body = oip_tensor_body(tensors, meta.input.name, meta.outputs.logits)
        output = _post(f"{live.url}/v2/models/{name}/infer", body)["outputs"][0]
        got = np.asarray(output["data"], np.float64).reshape(output["shape"])
        error = relative_error(got, logits)
        rows.append(
            [
                "/v2 infer, FP32 tensors: relative error of the logits",
                f"{error:.2e}",
                report.check(error < MAX_RELATIVE_ERROR["fp32"], "/v2 infer on CUDA"),
            ]
        )
        attention = _post(
            live.url + "/attention", json.dumps({"image": {"b64": encoded[0]}}).encode()
        )
        grid = np.asarray(attention["map"])
        ok = attention["prediction"]["index"] == reference.top_k(logits[0], 1)[0]["index"]
        ok &= grid.shape == tuple(attention["grid"]) and bool(np.isfinite(grid).all())
        rows.append(
            [
                "/attention: same top-1, a finite map of the model's grid",
                str(ok),
                report.check(ok, "/attention on CUDA"),
            ]
        )
    report.lines += [
        "## 2. The service on CUDA",
        "",
        "`VITSERVE_PROVIDER=cuda VITSERVE_WORKERS=2 python -m service`, against "
        "onnxruntime's CPU provider in this process.",
        "",
        table(["check", "measured", "result"], rows),
        "",
    ]


def engine_pid(root: int) -> int | None:
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "vitserve-engine":
                return pid
        except OSError:
            continue
    return None


def server_list(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """(label, VITSERVE_* settings or None for the plain server) of part 3."""
    extra = dict(args.setting)
    shown = "".join(f", {k}={v}" for k, v in extra.items())
    servers = [
        (
            f"vitserve, CUDA, {w} worker{'s' * (w != 1)}{shown}",
            {"provider": DEVICE_SETTING, "workers": w, **extra},
        )
        for w in args.workers
    ]
    if args.cpu_workers:
        servers.append(
            (
                f"vitserve, CPU, {args.cpu_workers} workers{shown}",
                {"provider": "cpu", "workers": args.cpu_workers, **extra},
            )
        )
    if args.plain:
        servers.append(("plain FastAPI + onnxruntime (CPU, batch 1)", None))
    return servers


def measure_load(report: Report, out: Path, args: argparse.Namespace) -> None:
    """Part 3: one server at a time, hey at each concurrency; the engine's event-loop thread's own
    CPU apart (at one core, it is what limits the server), and with ``--profile`` where it goes."""
    encoded = [base64.b64encode(png_bytes(i)).decode("ascii") for i in load_images(1)[0]]
    body = out / "body-predict-1.json"
    body.write_bytes(predict_body(encoded))
    plain = (sys.executable, "-m", "bench.baselines.plain_onnx_server", "--port", "{port}")
    rows, profiles = [], []
    for index, (label, settings) in enumerate(server_list(args)):
        argv = SERVICE if settings else plain
        env = (
            (lambda port, s=settings: service_env(port, model_repository=MODELS, **s))
            if settings
            else (lambda port: clean_env({}))
        )
        with running(argv, env, out / f"load-{index}.log", ports=PORTS, name=label) as live:
            url, root = live.url + "/predict", live.process.pid
            engine = engine_pid(root) if settings else None
            hey.run(hey.command(url, body, concurrency=8, requests=300), 120, args.hey_threads)
            for c in args.levels:
                before_batches = (
                    batch_counters(http_get(live.url + "/metrics")) if settings else (0.0, 0.0)
                )
                argv_hey = hey.command(url, body, concurrency=c, duration_s=args.seconds)
                loading = hey.start(argv_hey, args.hey_threads)
                time.sleep(0.5)  # past the ramp-up
                ticks, began = process_tree(root), time.monotonic()
                loop = thread_ticks(engine).get(engine, 0) if engine else 0
                window = max(1, round(args.seconds - 1.5))  # py-spy takes whole seconds
                if args.profile and engine and c == args.levels[-1]:
                    raw = out / f"engine-{index}.txt"
                    spy = [
                        py_spy(),
                        "record",
                        "--threads",
                        "--nonblocking",
                        "--rate",
                        "100",
                        "--pid",
                        str(engine),
                        "--duration",
                        str(window),
                        "--format",
                        "raw",
                    ]
                    subprocess.run([*spy, "--output", str(raw)], check=True, capture_output=True)
                    profiles.append((label, c, raw))
                else:
                    time.sleep(window)
                seconds = time.monotonic() - began
                used = cores_used(ticks, process_tree(root), seconds)
                loop_cores = (
                    (thread_ticks(engine).get(engine, 0) - loop) / CLOCK_TICKS / seconds
                    if engine
                    else None
                )
                got = hey.finish(loading, args.seconds + 60)
                after = batch_counters(http_get(live.url + "/metrics")) if settings else (0.0, 0.0)
                batches = after[1] - before_batches[1]
                mean_batch = f"{(after[0] - before_batches[0]) / batches:.1f}" if batches else ""
                rows.append(
                    [
                        label,
                        str(c),
                        f"{got.ok_rps:,.0f}",
                        _ms(got.ms(50)),
                        _ms(got.ms(99)),
                        str(got.not_ok + got.error_count),
                        f"{used:.1f}",
                        "" if loop_cores is None else f"{loop_cores:.2f}",
                        mean_batch,
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
    report.lines += [
        "## 3. Load: one base64 PNG per /predict request",
        "",
        f"{cores()} cores; hey with GOMAXPROCS={args.hey_threads}, {args.seconds:g} s a point, one "
        "run; cores: what the server's processes used (hey's own are not counted); engine loop: "
        "the engine's event-loop thread alone.",
        "",
        table(
            [
                "server",
                "c",
                "req/s",
                "p50 ms",
                "p99 ms",
                "failed",
                "cores",
                "engine loop",
                "mean batch",
            ],
            rows,
        ),
        "",
    ]
    for label, c, raw in profiles:
        report.lines += [
            f"Engine of {label}, c={c}: busiest innermost frames of its loop thread",
            "",
            *loop_frames(raw.read_text()),
            "",
        ]


def loop_frames(text: str, top: int = 12) -> list[str]:
    """The event-loop thread's (the main thread's) most sampled functions, self and inclusive."""
    loop = [s for s in parse_raw(text) if s.name == "MainThread"]
    total = sum(s.count for s in loop) or 1
    own, anywhere = Counter(), Counter()
    for stack in loop:
        own[stack.frames[-1]] += stack.count
        for frame in set(stack.frames):
            anywhere[frame] += stack.count
    return [
        *(f"- self {100 * n / total:.1f}%: `{f}`" for f, n in own.most_common(top)),
        *(f"- within {100 * n / total:.1f}%: `{f}`" for f, n in anywhere.most_common(top * 2)),
    ]


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def facts() -> list[str]:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = ""
    return [
        "# vitserve on CUDA (`python -m bench.cuda`)",
        "",
        f"- GPU: {smi or 'nvidia-smi found none'}",
        f"- onnxruntime {ort.__version__}, providers {', '.join(ort.get_available_providers())}",
        f"- Python {sys.version.split()[0]}, {cores()} cores, at "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results" / "cuda")
    parser.add_argument("--seconds", type=float, default=5.0, help="hey's duration per point")
    parser.add_argument("--hey-threads", type=int, default=4)
    parser.add_argument("--skip-load", action="store_true", help="parts 1 and 2 only")
    parser.add_argument("--load-only", action="store_true", help="part 3 only")
    parser.add_argument(
        "--workers",
        type=numbers,
        default=None,
        help="VITSERVE_WORKERS of each CUDA server (default: the cores, 4, 1)",
    )
    parser.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="VITSERVE_WORKERS of the CPU server, 0 for none (default: the cores)",
    )
    parser.add_argument("--no-plain", dest="plain", action="store_false")
    parser.add_argument("--levels", type=numbers, default=LEVELS)
    parser.add_argument(
        "--setting",
        type=setting,
        action="append",
        default=[],
        help="a VITSERVE_* setting for every vitserve server, e.g. max_batch_size=64",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy on each engine at the last level"
    )
    args = parser.parse_args(argv)
    args.workers = args.workers or [cores(), 4, 1]
    args.cpu_workers = cores() if args.cpu_workers is None else args.cpu_workers
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if DEVICE not in ort.get_available_providers():
        print(
            f"onnxruntime {ort.__version__} offers no {CUDA}: install onnxruntime-gpu", flush=True
        )
        return 2
    args.results_dir.mkdir(parents=True, exist_ok=True)
    report = Report(facts(), [])
    images, source = load_images(10_000)
    report.lines += [f"Images: {source}.", ""]
    parts = (
        []
        if args.load_only
        else [
            lambda: check_models(report, images, labels(len(images))),
            lambda: check_service(report, args.results_dir, images),
        ]
    )
    if not args.skip_load:
        parts.append(lambda: measure_load(report, args.results_dir, args))
    for part in parts:
        try:
            part()
        except Exception as error:  # one part failing still reports the others
            report.failures.append(f"{part.__name__}: {error!r}")
            report.lines += [f"**A part failed**: `{error!r}`", ""]
    if report.failures:
        report.lines += ["**Failed:** " + "; ".join(report.failures), ""]
    text = "\n".join(report.lines)
    print(text, flush=True)
    if args.output:
        args.output.write_text(text + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
