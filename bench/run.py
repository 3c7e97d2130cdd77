"""``python -m bench``: every benchmark in one run, then BENCHMARKS.md.

    python -m bench                 # the full run; writes BENCHMARKS.md
    python -m bench --quick         # a smoke run of every code path (under 2 minutes)
    python -m bench --only swap     # some steps
A smoke run or some steps write bench/results/*/BENCHMARKS.md unless --output says otherwise.

Steps, in this order: the model alone (bench/inprocess.py), vitserve against the plain servers and
the anchors, mosec and Triton, with the in-process ceiling (bench/compare.py), where the service's core
time goes (bench/profile.py), a live model swap under load (bench/swap.py), a phone photo to
the model's input (bench/decode.py), and the servers again at the real size, ViT-Ti/16 and ViT-S/16 on
JPEG photos (bench/real_size.py). The anchors run in
venvs of their own, made from PyPI on the first run (bench/baselines/venvs.py). Each step returns a typed result that renders its own
section; a step that fails is reported in the document and the others still run. Raw results (JSON,
server logs, the flame graph) go to bench/results/ (not committed). Stop other work on the machine
first: the run checks, and the document says when the machine was busy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import compare, decode, hey, inprocess, profile, real_size, swap
from bench.machine import busy_check, machine_rows
from bench.server_process import REPO
from bench.stats import table
from export.cli import command_parser

MODEL_DIR = REPO / "models" / "fashion-mnist-vit" / "1"
INT8_DIR = REPO / "models" / "fashion-mnist-vit-int8" / "1"  # the same model, quantised
# served beside the defaults in every run (comparison.py holds it against fp32)
INT8 = {"int8": {"model_name": INT8_DIR.parent.name}} if INT8_DIR.is_dir() else {}
PACKAGES = (
    "onnxruntime",
    "torch",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "numpy",
    "pillow",
)
STEPS = ("model", "compare", "profile", "swap", "decode", "real")


def _git() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = " with uncommitted changes" if git("status", "--porcelain") else ""
    return git("rev-parse", "--short", "HEAD") + dirty


def _variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:setting=value[,setting=value]``, e.g. ``intra1:intra_op_threads=1``."""
    name, _, settings = text.partition(":")
    pairs = [pair.partition("=") for pair in settings.split(",") if pair]
    if not name or not pairs or any(not key or not sep for key, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:setting=value,...")
    return name, {key.strip().lower(): value.strip() for key, _, value in pairs}


def steps(args: argparse.Namespace, out: Path) -> dict[str, Callable[[], object]]:
    quick = args.quick
    return {
        "model": lambda: inprocess.model_cost(
            {d.parent.name: d for d in (MODEL_DIR, INT8_DIR) if d.is_dir()},
            (1, 32) if quick else inprocess.BATCHES,
            1 if quick else 3,
            0.05 if quick else 0.5,
        ),
        "compare": lambda: compare.run(
            out, MODEL_DIR, compare.Plan.for_run(quick), {**INT8, **dict(args.variant or [])}
        ),
        "profile": lambda: profile.run(out, MODEL_DIR, 3.0 if quick else 20.0),
        "swap": lambda: swap.run(out, MODEL_DIR, swap.Phases.for_run(quick)),
        "decode": lambda: decode.run(1 if quick else 9, with_model=not quick),
        "real": lambda: real_size.run(out / "real-size", real_size.Plan.for_run(quick)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("bench", __doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run of every code path")
    parser.add_argument("--output", type=Path, help="the Markdown file to write")
    parser.add_argument("--results-dir", type=Path, help="raw results (default: bench/results/)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    parser.add_argument(
        "--variant",
        type=_variant,
        action="append",
        help="a vitserve variant: NAME:setting=value,...",
    )
    args = parser.parse_args(argv)
    started, began = dt.datetime.now(dt.UTC), time.monotonic()
    kind = "quick" if args.quick else "full"
    out = args.results_dir or REPO / "bench" / "results" / f"{kind}-{started:%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    whole = not args.quick and set(wanted) >= set(STEPS)  # only a whole run replaces BENCHMARKS.md
    output = args.output or (REPO / "BENCHMARKS.md" if whole else out / "BENCHMARKS.md")
    busy = busy_check(interval_s=2.0)
    if busy.busy:
        print(f"!!! the machine is busy: {busy.describe()}", flush=True)
    sections, failures = [], {}
    for name, step in steps(args, out).items():
        if name not in wanted:
            continue
        print(f"== {name}", flush=True)
        try:
            result = step()
        except Exception as error:  # a failed step is reported; the others still run
            traceback.print_exc()
            failures[name] = f"{type(error).__name__}: {error}"
            continue
        raw = json.dumps(dataclasses.asdict(result), indent=1, default=str)
        (out / f"{name}.json").write_text(raw)
        sections.append(result.markdown())
    banners = []
    if args.quick:
        banners.append(
            "**SMOKE RUN (`--quick`): these numbers test the code; they are not results.**"
        )
    if busy.busy:
        banners.append(f"**THE MACHINE WAS BUSY at the start:** {busy.describe()}.")
    banners += [f"**{name} FAILED:** `{error}`" for name, error in failures.items()]
    command = " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])])
    document = [
        "# Benchmarks",
        "",
        *(line for banner in banners for line in (f"> {banner}", "")),
        f"Written by `{command}` (the full run: `python -m bench`, or `make bench`), "
        f"{started:%Y-%m-%d %H:%M} UTC, {(time.monotonic() - began) / 60:.1f} min, git {_git()}, "
        f"hey {hey.version()}. Raw results: `{out.relative_to(REPO) if out.is_relative_to(REPO) else out}`.",
        "",
        "## Machine",
        "",
        table(["", ""], machine_rows(PACKAGES)),
        *(line for section in sections for line in ("", section)),
        "",
        "## On a GPU",
        "",
        "This run is the CPU's. `python -m bench.cuda` checks and measures the service on an NVIDIA "
        "GPU; what it measured on an H200, and what comes next there: [docs/gpu.md](docs/gpu.md).",
    ]
    output.write_text("\n".join(document) + "\n")
    print(f"== wrote {output} in {(time.monotonic() - began) / 60:.1f} min", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
