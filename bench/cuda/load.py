"""Part 3 of ``python -m bench.cuda``: load, one server at a time (vitserve on the device at each
worker count, on the CPU, and the plain server), with the cores each one's processes used and the
engine's event-loop thread apart."""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench import hey
from bench.compare import batch_counters
from bench.contenders import cores
from bench.cuda.common import DEVICE_SETTING, MODELS, PORTS, Report
from bench.machine import CLOCK_TICKS, cores_used, descendants, process_tree, thread_ticks
from bench.payloads import load_images, png_bytes, predict_body
from bench.profile import parse_raw, py_spy
from bench.server_process import SERVICE, clean_env, http_get, running, service_env
from bench.stats import table


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
