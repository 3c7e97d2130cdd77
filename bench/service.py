"""The load driver: the service and the baseline over HTTP under ``hey``, plus the in-process ceiling.

``python -m bench.service --json OUT [--quick]``

Starts every server as its own process (``python -m service`` configured through ``VITSERVE_*``
variables; the baseline in bench/baselines/), measures spawn-to-ready time, warms each case, then
repeats a sweep over cases x concurrency levels with fixed-duration ``hey`` runs. Repeats are
interleaved (every case once, then every case again) so slow drift hits all cases alike. Before each
run it samples the machine for a second and flags the run when something other than our (idle)
servers was using the CPUs. Each repeat also times the ceiling: decode + preprocess + onnxruntime at
batch 32 in this process, with the service's own modules and session options, no HTTP.
After the sweep: each server's resident memory (VmRSS) and peak (VmHWM).

Ports 18110-18129 on 127.0.0.1. Every server is stopped on the way out, whatever happens
(process groups, SIGTERM then SIGKILL, and PR_SET_PDEATHSIG should this driver itself be killed).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import hey
from bench.machine import busy_check, process_memory_kib
from bench.payloads import attention_body, b64_pngs, predict_body
from bench.server_process import (
    HOST,
    REPO,
    clean_env,
    log_tail,
    port_is_free,
    spawn,
    stop_process,
    wait_ready,
)
from bench.stats import rate, summarize

FIRST_PORT = 18110
READY_TIMEOUT_S = 120.0
# Every other VITSERVE_* variable of this process is dropped so that each server runs exactly the
# settings its case names; these pass through, so that `VITSERVE_PROVIDER=cuda python -m bench`
# measures the service on a GPU.
PASS_THROUGH = (
    "VITSERVE_PROVIDER",
    "VITSERVE_CUDA_DEVICE_ID",
    "VITSERVE_CUDNN_CONV_ALGO_SEARCH",
    "VITSERVE_CUDA_MEM_LIMIT_BYTES",
)


@dataclass
class ServerSpec:
    key: str
    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0


@dataclass
class Case:
    key: str
    label: str
    server: str
    path: str
    body: str
    images_per_request: int
    concurrency: list[int]


class Server:
    """One server process in its own process group, logging to a file."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.key}.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.spec.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> float:
        """Spawn, wait for /health/ready to answer 200; returns the seconds that took."""
        if not port_is_free(self.spec.port):
            raise RuntimeError(f"port {self.spec.port} is in use; is another benchmark running?")
        started = time.perf_counter()
        # Appended: the start-up repeats of one server share its log.
        self.process = spawn(self.spec.argv, clean_env(self.spec.env), self.log_path, append=True)
        wait_ready(
            self.process,
            self.base_url,
            self.log_path,
            timeout_s=READY_TIMEOUT_S,
            name=self.spec.key,
        )
        return time.perf_counter() - started

    def startup_breakdown(self) -> dict[str, float] | None:
        """The service's own log line: seconds to load the model and to warm it up (last start)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        found = _STARTED.findall(text)
        if not found:
            return None
        load, _, warm = found[-1]
        return {"load_s": float(load), "warmup_s": float(warm)}

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def memory(self) -> dict[str, int | None]:
        return process_memory_kib(self.pid) if self.pid else {"VmRSS": None, "VmHWM": None}

    def metrics_text(self) -> str | None:
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as answer:
                return answer.read().decode()
        except (urllib.error.URLError, OSError):
            return None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_process(process, timeout_s=20.0)


_STARTED = re.compile(r"loaded in ([0-9.]+) s, warmed up at batch sizes 1-([0-9]+) in ([0-9.]+) s")
_METRIC = re.compile(r'^(vitserve_\w+)\{graph="(\w+)"\}\s+([0-9.eE+-]+)$', re.MULTILINE)


def batching_counters(metrics: str | None, graph: str = "classifier") -> dict[str, float]:
    """Sums and counts of the batch size, compute and queue-wait histograms of one graph."""
    wanted = {
        f"vitserve_{name}_{part}"
        for name in ("batch_size", "compute_seconds", "queue_wait_seconds")
        for part in ("sum", "count")
    }
    values = {}
    for name, label, value in _METRIC.findall(metrics or ""):
        if label == graph and name in wanted:
            values[name] = float(value)
    return values


def batching_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Average batch size, compute per batch and queue wait per image between two snapshots."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = delta("vitserve_batch_size_count")
    waits = delta("vitserve_queue_wait_seconds_count")
    return {
        "batches": batches,
        "avg_batch_size": delta("vitserve_batch_size_sum") / batches if batches else None,
        "avg_compute_ms": 1000 * delta("vitserve_compute_seconds_sum") / batches
        if batches
        else None,
        "avg_queue_wait_ms": 1000 * delta("vitserve_queue_wait_seconds_sum") / waits
        if waits
        else None,
    }


def service_argv() -> list[str]:
    return [sys.executable, "-m", "service"]


def service_env(port: int, **settings: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
    env.update({"VITSERVE_HOST": HOST, "VITSERVE_PORT": str(port)})
    env.update({f"VITSERVE_{k.upper()}": v for k, v in settings.items()})
    return env


def plan(quick: bool, checkpoint: Path) -> tuple[list[ServerSpec], list[Case]]:
    levels = [16] if quick else [1, 16, 64, 256]
    variant_levels = [16] if quick else [64]
    specs = [
        ServerSpec("service", "service (defaults: dynamic batching, max batch 32)", service_argv()),
        ServerSpec(
            "service-nobatch",
            "service, batching off (max batch 1)",
            service_argv(),
            {"max_batch_size": "1"},
        ),
        ServerSpec(
            "baseline",
            "baseline: FastAPI + PyTorch eager, one image per forward",
            [
                sys.executable,
                "-m",
                "bench.baselines.torch_eager_server",
                "--checkpoint",
                str(checkpoint),
                "--host",
                HOST,
            ],
        ),
    ]
    variants = [("service-intra1", "service, intra-op threads 1", {"intra_op_threads": "1"})]
    if not quick:
        variants += [
            ("service-spin", "service, onnxruntime thread spinning on", {"allow_spinning": "true"}),
            ("service-delay0", "service, max queue delay 0 ms", {"max_queue_delay_ms": "0"}),
            ("service-delay5", "service, max queue delay 5 ms", {"max_queue_delay_ms": "5"}),
            (
                "service-quietlog",
                "service, log level warning (no uvicorn access log)",
                {"log_level": "warning"},
            ),
        ]
    specs += [ServerSpec(key, label, service_argv(), env) for key, label, env in variants]
    for index, spec in enumerate(specs):
        spec.port = FIRST_PORT + index
        if spec.key == "baseline":
            spec.argv += ["--port", str(spec.port)]
            spec.env = {}
        else:
            spec.env = service_env(spec.port, **spec.env)
    cases = [
        Case("batching", "service, 1 image/request", "service", "/predict", "single", 1, levels),
        Case(
            "no-batching",
            "service batching off, 1 image/request",
            "service-nobatch",
            "/predict",
            "single",
            1,
            levels,
        ),
        Case(
            "baseline",
            "baseline (PyTorch eager), 1 image/request",
            "baseline",
            "/predict",
            "single",
            1,
            levels,
        ),
        Case("batch32", "service, 32 images/request", "service", "/predict", "batch32", 32, levels),
        Case(
            "attention-json",
            "service /attention, JSON",
            "service",
            "/attention",
            "attention_json",
            1,
            levels,
        ),
        Case(
            "attention-png",
            "service /attention, PNG",
            "service",
            "/attention",
            "attention_png",
            1,
            levels,
        ),
    ]
    cases += [
        Case(key, f"{label}, 1 image/request", key, "/predict", "single", 1, variant_levels)
        for key, label, _ in variants
    ]
    return specs, cases


def write_bodies(directory: Path) -> tuple[dict[str, Path], str]:
    encoded, source = b64_pngs(32)
    bodies = {
        "single": predict_body(encoded[:1]),
        "batch32": predict_body(encoded),
        "attention_json": attention_body(encoded[0], "json"),
        "attention_png": attention_body(encoded[0], "png"),
    }
    paths = {}
    for key, body in bodies.items():
        paths[key] = directory / f"{key}.json"
        paths[key].write_bytes(body)
    return paths, source


class Ceiling:
    """Decode + preprocess + onnxruntime at batch 32 in this process: the service's modules, no HTTP."""

    def __init__(self, body: Path) -> None:
        from service.preprocessing import Preprocessor
        from service.runtime import Runtime
        from service.settings import Settings

        settings = Settings(model_repository=REPO / "models")  # provider: as the servers'
        self.runtime = Runtime.load(settings)
        self.preprocessor = Preprocessor(self.runtime.metadata, settings.max_pixels_per_image)
        self.encoded = [image["b64"] for image in json.loads(body.read_bytes())["images"]]

    def batch(self) -> None:
        files = [base64.b64decode(e, validate=True) for e in self.encoded]
        tensors = np.stack([self.preprocessor.from_bytes(f, "f").tensor for f in files])
        self.runtime.classify(tensors)

    def images_per_s(self, min_time_s: float) -> float:
        return rate(self.batch, len(self.encoded), min_time_s, 3)


def run_point(
    server: Server,
    case: Case,
    concurrency: int,
    body: Path,
    duration_s: float,
    own_pids: set[int],
    repeat: int,
) -> dict:
    check = busy_check(own_pids)
    if check.busy:
        print(
            f"  !!! BUSY MACHINE before {case.key} c={concurrency}: {check.describe()}", flush=True
        )
    argv = hey.command(
        server.base_url + case.path, body, concurrency=concurrency, duration_s=duration_s
    )
    before = batching_counters(server.metrics_text()) if case.server != "baseline" else {}
    result, _ = hey.run(argv, wall_limit_s=duration_s + 90)
    after = batching_counters(server.metrics_text()) if case.server != "baseline" else {}
    p = result.percentiles_s
    point = {
        "case": case.key,
        "concurrency": concurrency,
        "repeat": repeat,
        "command": " ".join(argv),
        "ok_rps": result.ok_rps,
        "images_per_s": result.ok_rps * case.images_per_request,
        # hey omits a percentile it has too few answers for (p99 needs 100): None, not 0.
        "p50_ms": p[50] * 1000 if 50 in p else None,
        "p90_ms": p[90] * 1000 if 90 in p else None,
        "p99_ms": p[99] * 1000 if 99 in p else None,
        "ok": result.ok,
        "not_ok": result.not_ok,
        "errors": result.error_count,
        "hey": result.to_dict(),
        "busy": check.to_dict(),
        "batching": batching_delta(before, after) if before or after else None,
    }
    flag = " BUSY" if check.busy else ""
    extra = ""
    if point["batching"] and point["batching"]["avg_batch_size"]:
        extra = f", avg batch {point['batching']['avg_batch_size']:.1f}"
    print(
        f"  r{repeat} {case.key:<16} c={concurrency:<3} {result.ok_rps:>8,.0f} req/s "
        f"{point['images_per_s']:>8,.0f} img/s p50 {_ms(point['p50_ms'])} "
        f"p99 {_ms(point['p99_ms'])} non-200 {result.not_ok} errors "
        f"{result.error_count}{extra}{flag}",
        flush=True,
    )
    return point


def _ms(value: float | None) -> str:
    return f"{value:>7.1f} ms" if value is not None else "      - ms"


def summarize_points(points: list[dict], cases: list[Case]) -> dict:
    summary: dict[str, dict] = {}
    for case in cases:
        summary[case.key] = {"label": case.label, "levels": {}}
        for level in case.concurrency:
            mine = [p for p in points if p["case"] == case.key and p["concurrency"] == level]
            if not mine:
                continue
            batch_sizes = [
                p["batching"]["avg_batch_size"]
                for p in mine
                if p["batching"] and p["batching"]["avg_batch_size"]
            ]
            summary[case.key]["levels"][str(level)] = {
                "ok_rps": summarize([p["ok_rps"] for p in mine]),
                "images_per_s": summarize([p["images_per_s"] for p in mine]),
                "p50_ms": summarize([p["p50_ms"] for p in mine]),
                "p90_ms": summarize([p["p90_ms"] for p in mine]),
                "p99_ms": summarize([p["p99_ms"] for p in mine]),
                "not_ok": sum(p["not_ok"] for p in mine),
                "status_codes": _merge_counts(p["hey"]["status_codes"] for p in mine),
                "errors": sum(p["errors"] for p in mine),
                "error_kinds": _merge_counts(p["hey"]["errors"] for p in mine),
                "busy_runs": sum(1 for p in mine if p["busy"]["busy"]),
                "runs": len(mine),
                "avg_batch_size": summarize(batch_sizes),
            }
    return summary


def _merge_counts(dicts) -> dict[str, int]:
    merged: dict[str, int] = {}
    for counts in dicts:
        for key, value in counts.items():
            merged[key] = merged.get(key, 0) + value
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="smoke run: one level, one repeat")
    parser.add_argument("--duration", type=float, default=None, help="seconds per hey run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds after which the remaining load runs are skipped (and reported as skipped)",
    )
    args = parser.parse_args(argv)
    budget = args.budget or (240.0 if args.quick else 780.0)
    duration = args.duration or (2.0 if args.quick else 5.0)
    repeats = args.repeats or (1 if args.quick else 3)
    startup_repeats = 1 if args.quick else 3
    hey.hey_binary()
    started = time.perf_counter()

    def on_term(signum, frame):  # let the finally blocks stop the servers
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    servers: dict[str, Server] = {}
    results: dict = {
        "duration_s": duration,
        "repeats": repeats,
        "budget_s": budget,
        "points": [],
    }
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-") as tmp_name:
        tmp = Path(tmp_name)
        bodies, source = write_bodies(tmp)
        results["images"] = source
        results["body_bytes"] = {k: p.stat().st_size for k, p in bodies.items()}
        checkpoint = tmp / "baseline.safetensors"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.baselines.torch_eager_server",
                "--write-checkpoint",
                str(checkpoint),
            ],
            cwd=REPO,
            check=True,
        )
        specs, cases = plan(args.quick, checkpoint)
        results["servers"] = {
            s.key: {"label": s.label, "argv": " ".join(s.argv[1:]), "env": s.env, "port": s.port}
            for s in specs
        }
        results["cases"] = [case.__dict__ for case in cases]
        total_runs = sum(len(c.concurrency) for c in cases) * repeats
        estimate = total_runs * (duration + 1.5) + 10 * len(specs) + startup_repeats * 6
        print(
            f"service: {len(specs)} servers, {total_runs} runs of {duration:g} s, "
            f"about {estimate / 60:.1f} min",
            flush=True,
        )
        try:
            # Start-up time of the service, on an otherwise idle machine: spawn to /health/ready.
            results["startup_busy"] = busy_check().to_dict()
            startup: dict[str, list[float]] = {s.key: [] for s in specs}
            for spec in specs:
                server = servers[spec.key] = Server(spec, tmp)  # registered first: always stopped
                times = startup_repeats if spec.key in ("service", "baseline") else 1
                for attempt in range(times):
                    seconds = server.start()
                    startup[spec.key].append(seconds)
                    breakdown = server.startup_breakdown()
                    if breakdown:
                        results.setdefault("startup_breakdown", {}).setdefault(spec.key, []).append(
                            breakdown
                        )
                    print(f"  {spec.key}: ready in {seconds:.2f} s", flush=True)
                    if attempt < times - 1:
                        server.stop()
            results["startup_s"] = {k: summarize(v) for k, v in startup.items()}
            results["startup_samples_s"] = startup
            results["idle_memory_kib"] = {k: s.memory() for k, s in servers.items()}
            own = {s.pid for s in servers.values() if s.pid}
            for case in cases:  # warm-up: not recorded
                hey.run(
                    hey.command(
                        servers[case.server].base_url + case.path,
                        bodies[case.body],
                        concurrency=8,
                        requests=40 if args.quick else 200,
                    ),
                    wall_limit_s=120,
                )
            ceiling = Ceiling(bodies["batch32"])
            ceiling.images_per_s(0.2)
            ceiling_samples = []
            for repeat in range(repeats):
                ceiling_samples.append(ceiling.images_per_s(0.5 if args.quick else 2.0))
                print(f"  r{repeat} ceiling: {ceiling_samples[-1]:,.0f} img/s", flush=True)
                order = cases if repeat % 2 == 0 else list(reversed(cases))
                for case in order:
                    for level in case.concurrency:
                        if time.perf_counter() - started > budget:
                            results["skipped_runs"] = results.get("skipped_runs", 0) + 1
                            continue
                        results["points"].append(
                            run_point(
                                servers[case.server],
                                case,
                                level,
                                bodies[case.body],
                                duration,
                                own,
                                repeat,
                            )
                        )
            results["ceiling_images_per_s"] = summarize(ceiling_samples)
            results["ceiling_samples"] = ceiling_samples
            results["memory_kib"] = {k: s.memory() for k, s in servers.items()}
            for key, server in servers.items():
                if server.process is not None and server.process.poll() is not None:
                    results.setdefault("crashed", []).append(key)
        finally:
            for server in servers.values():
                server.stop()
    results["summary"] = summarize_points(results["points"], cases)
    results["busy_runs"] = sum(1 for p in results["points"] if p["busy"]["busy"])
    results["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"service: done in {results['seconds']:.0f} s -> {args.json}", flush=True)
    if results.get("skipped_runs"):
        print(
            f"!!! WARNING: {results['skipped_runs']} load runs skipped: past the time budget of "
            f"{budget:.0f} s",
            flush=True,
        )
    if results["busy_runs"]:
        print(
            f"!!! WARNING: {results['busy_runs']} of {len(results['points'])} runs started on a busy "
            "machine; their numbers are not results",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
