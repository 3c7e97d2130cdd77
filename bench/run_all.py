"""Run every benchmark and write BENCHMARKS.md: ``python -m bench`` (or ``python -m bench.run_all``).

    python -m bench            # the full run, about 14 minutes on 2 cores; writes BENCHMARKS.md
    python -m bench --quick    # a smoke run of every code path, about 2 minutes; writes
                               # bench/results/quick-*/BENCHMARKS.md unless --output says otherwise

Each benchmark runs in its own process (bench.engine, bench.micro, bench.service) with a time limit,
writing JSON into the results directory (bench/results/, not committed); a failing one is reported in
the document and the others still run. Stop anything else on the machine first: the run checks before
it starts and before every load run, and says loudly in the output and in BENCHMARKS.md when the
machine was busy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import hey
from bench.machine import busy_check, machine_info, package_versions
from bench.report import load, render

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "onnxruntime",
    "torch",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "numpy",
    "pillow",
    "orjson",
    "uvloop",
    "httptools",
)
# (module, wall limit in seconds for the full run, for --quick)
STEPS = (
    ("engine", 420, 240),
    ("micro", 300, 180),
    ("service", 900, 300),
)


def _git() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' with uncommitted changes' if dirty else ''}"


def run_step(argv: list[str], limit_s: float) -> int | None:
    """Run one benchmark; past its limit, SIGTERM (it stops its servers), then SIGKILL. None if stopped."""
    process = subprocess.Popen(argv, cwd=REPO)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return None
    except BaseException:
        process.terminate()
        process.wait(timeout=60)
        raise


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run of every code path")
    parser.add_argument("--output", type=Path, default=None, help="the Markdown file to write")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument(
        "--only",
        default="engine,micro,service",
        help="comma-separated subset of engine,micro,service",
    )
    args = parser.parse_args(argv)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "quick" if args.quick else "full"
    results_dir = args.results_dir or REPO / "bench" / "results" / f"{kind}-{stamp}"
    results_dir.mkdir(parents=True, exist_ok=True)
    output = args.output or (
        results_dir / "BENCHMARKS.md" if args.quick else REPO / "BENCHMARKS.md"
    )
    wanted = {s.strip() for s in args.only.split(",") if s.strip()}
    started = time.perf_counter()
    command = "python -m bench" + ("".join(f" {a}" for a in (argv or sys.argv[1:])))
    meta: dict = {
        "command": command,
        "quick": args.quick,
        "started": _now(),
        "git": _git(),
        "machine": machine_info(),
        "versions": {**package_versions(PACKAGES), "hey": hey.version()},
        "results_dir": str(
            results_dir.relative_to(REPO) if results_dir.is_relative_to(REPO) else results_dir
        ),
        "commands": [],
        "failures": {},
    }
    hey.hey_binary()
    check = busy_check(interval_s=2.0)
    meta["busy_at_start"] = {**check.to_dict(), "describe": check.describe()}
    if check.busy:
        print(
            f"!!! WARNING: the machine is busy: {check.describe()}\n!!! the numbers of this run "
            "will not be results; stop the other work and rerun",
            flush=True,
        )
    for name, full_limit, quick_limit in STEPS:
        if name not in wanted:
            continue
        step = [sys.executable, "-m", f"bench.{name}", "--json", str(results_dir / f"{name}.json")]
        if args.quick:
            step.append("--quick")
        shown = " ".join(["python", *step[1:]]).replace(str(REPO) + "/", "")
        meta["commands"].append(f"`{shown}`")
        limit = quick_limit if args.quick else full_limit
        print(f"== {shown} (limit {limit} s)", flush=True)
        status = run_step(step, limit)
        if status is None:
            meta["failures"][name] = f"ran past its limit of {limit} s and was stopped"
        elif status != 0:
            meta["failures"][name] = f"exited with status {status}"
        if name in meta["failures"]:
            print(f"!!! {name}: {meta['failures'][name]}", flush=True)
    meta["finished"] = _now()
    meta["seconds"] = time.perf_counter() - started
    (results_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    document = render(load(results_dir))
    output.write_text(document)
    if output != results_dir / "BENCHMARKS.md":
        (results_dir / "BENCHMARKS.md").write_text(document)
    print(
        f"== wrote {output} ({meta['seconds'] / 60:.1f} min); raw results in {results_dir}",
        flush=True,
    )
    return 1 if meta["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
