"""The command line of ``python -m bench.cuda`` (the package's docstring says what it does)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import onnxruntime as ort

import bench.cuda
from bench.contenders import cores
from bench.cuda.check import check_models, check_service, labels
from bench.cuda.common import CUDA, DEVICE, LEVELS, Report
from bench.cuda.load import measure_load
from bench.payloads import load_images
from bench.server_process import REPO


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"--setting {text!r}: expected name=value")
    return key.strip().lower(), value.strip()


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
    parser = argparse.ArgumentParser(
        prog="python -m bench.cuda", description=(bench.cuda.__doc__ or "").split("\n")[0]
    )
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
