"""vitserve against the servers a user would run instead, over HTTP under ``hey``, in one run.

- vitserve: ``python -m service`` with its defaults (and each ``--variant``: one setting changed);
- plain: bench/baselines/plain_onnx_server.py, FastAPI + onnxruntime, batch 1, one intra-op thread;
- torch: bench/baselines/torch_eager_server.py, the same server with PyTorch eager;
- nomodel: bench/baselines/no_model_server.py, the plain server with no model run at all (what
  everything but the model costs a FastAPI server here: the bound the in-process ceiling meets).

Single-image requests go to every server; 32-image requests to vitserve, while the plain server's
images/s for the same images is its single-image rate. Each repeat measures every case at every
concurrency level, the cases alternated (order reversed every other repeat) so that drift hits them
alike, and the in-process ceiling (bench/inprocess.py) at each batch size; medians over the repeats.
Before each run the machine is checked for other work (bench/machine.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench import hey
from bench.comparison import TARGET_LEVELS, Comparison, Point, Start
from bench.inprocess import Ceiling
from bench.machine import busy_check, tree_memory_kib
from bench.payloads import b64_pngs, predict_body
from bench.server_process import REPO, SERVICE, clean_env, http_get, running, service_env
from bench.stats import Spread

PORTS = range(18110, 18140)
LEVELS = (1, 16, 64, 256)


@dataclass(frozen=True)
class Server:
    key: str
    label: str
    argv: tuple[str, ...]  # "{port}" is replaced by the port it gets
    settings: dict[str, str] | None = None  # VITSERVE_* settings: a vitserve server

    def shown(self) -> str:
        argv = " ".join(["python", *self.argv[1:]]).replace("{port}", "PORT")
        return f"{_settings(self.settings)} {argv}" if self.settings else argv

    def env(self, port: int, model_dir: Path) -> dict[str, str]:
        if self.settings is None:
            return clean_env({})
        return service_env(port, model_repository=model_dir.parents[1], **self.settings)


def servers(model_dir: Path, variants: dict[str, dict[str, str]]) -> list[Server]:
    shown = model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir
    baseline = ("--port", "{port}", "--model-dir", str(shown))
    return [
        Server("vitserve", "vitserve (defaults)", SERVICE, {}),
        *(Server(k, f"vitserve, {_settings(v)}", SERVICE, v) for k, v in variants.items()),
        Server(
            "plain",
            "plain FastAPI + onnxruntime, batch 1, 1 thread",
            (sys.executable, "-m", "bench.baselines.plain_onnx_server", *baseline),
        ),
        Server(
            "torch",
            "plain FastAPI + PyTorch eager, batch 1",
            (sys.executable, "-m", "bench.baselines.torch_eager_server", *baseline),
        ),
        Server(
            "nomodel",
            "the plain server with no model (every logit 0)",
            (sys.executable, "-m", "bench.baselines.no_model_server", *baseline),
        ),
    ]


def _settings(settings: dict[str, str]) -> str:
    return " ".join(f"VITSERVE_{k.upper()}={v}" for k, v in settings.items()) or "defaults"


@dataclass(frozen=True)
class Case:
    server: str
    images: int  # per request
    levels: tuple[int, ...]


def cases(keys: list[str], levels: tuple[int, ...]) -> list[Case]:
    """Single images to every server (PyTorch and no-model only at the target levels), 32 images to
    vitserve."""
    targets_only = tuple(c for c in levels if c in TARGET_LEVELS) or levels
    single = [Case(k, 1, targets_only if k in ("torch", "nomodel") else levels) for k in keys]
    return [*single, Case("vitserve", 32, levels)]


def load_breakdown(metrics: str | None) -> dict[str, float]:
    """Seconds per start-up phase from ``vitserve_model_load_seconds`` (summed over models)."""
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics or ""):
        if family.name == "vitserve_model_load_seconds":
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                phases[phase] = phases.get(phase, 0.0) + sample.value
    return phases


def batch_counters(metrics: str | None) -> tuple[float, float]:
    """(images, batches) the classifier has run so far, from ``vitserve_batch_size``."""
    images = batches = 0.0
    for family in text_string_to_metric_families(metrics or ""):
        if family.name == "vitserve_batch_size":
            for sample in family.samples:
                if sample.labels.get("graph", "classifier") != "classifier":
                    continue
                if sample.name.endswith("_sum"):
                    images += sample.value
                elif sample.name.endswith("_count"):
                    batches += sample.value
    return images, batches


@dataclass(frozen=True)
class Plan:
    levels: tuple[int, ...]
    duration_s: float
    repeats: int
    starts: int  # spawn-to-ready measurements of vitserve
    ceiling_batches: tuple[int, ...]
    ceiling_s: float
    warm_requests: int
    budget_s: float

    @classmethod
    def for_run(cls, quick: bool) -> Plan:
        if quick:
            return cls((64,), 2.0, 1, 1, (32,), 0.5, 40, 120.0)
        return cls(LEVELS, 12.0, 3, 3, (1, 8, 32, 64), 2.0, 300, 900.0)


def run(
    out: Path, model_dir: Path, plan: Plan, variants: dict[str, dict[str, str]] | None = None
) -> Comparison:
    """Start every server, measure, stop them; raw files (bodies, logs) go to ``out``."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    encoded, source = b64_pngs(32)
    bodies = {n: out / f"body-{n}.json" for n in (1, 32)}
    for n, path in bodies.items():
        path.write_bytes(predict_body(encoded[:n]))
    plan_servers = servers(model_dir, variants or {})
    result = Comparison(
        {s.key: s.label for s in plan_servers}, plan.duration_s, plan.repeats, source
    )
    work = cases([s.key for s in plan_servers], plan.levels)
    with contextlib.ExitStack() as stack:
        urls, pids = {}, {}
        for index, server in enumerate(plan_servers):
            result.commands.append(server.shown())
            url, pid, start = _start(stack, server, model_dir, out, index, plan.starts)
            urls[server.key], pids[server.key], result.starts[server.key] = url, pid, start
        ceiling = Ceiling(model_dir, encoded)
        stack.callback(ceiling.close)
        result.ceiling_processes = len(ceiling.processes)
        own = set(pids.values()) | ceiling.pids
        for case in work:
            hey.run(
                hey.command(
                    urls[case.server] + "/predict",
                    bodies[case.images],
                    concurrency=8,
                    requests=plan.warm_requests,
                ),
                wall_limit_s=120,
            )
        for repeat in range(plan.repeats):
            for batch in plan.ceiling_batches:
                result.ceiling.setdefault(batch, []).append(
                    ceiling.images_per_s(batch, plan.ceiling_s)
                )
            for c in plan.levels:
                order = [case for case in work if c in case.levels]
                for case in order if repeat % 2 == 0 else reversed(order):
                    if time.monotonic() - started > plan.budget_s:
                        result.skipped += 1
                        continue
                    argv = hey.command(
                        urls[case.server] + "/predict",
                        bodies[case.images],
                        concurrency=c,
                        duration_s=plan.duration_s,
                    )
                    if repeat == 0 and c == plan.levels[-1]:
                        result.commands.append(hey.shown(argv))
                    point = _point(case, c, repeat, argv, urls[case.server], own, plan)
                    result.points.append(point)
                    print(f"  r{repeat} {point}", flush=True)
        for key, pid in pids.items():
            peak = tree_memory_kib(pid)["VmHWM"]
            result.starts[key] = dataclasses.replace(result.starts[key], peak_kib=peak)
    return result


def _start(
    stack: contextlib.ExitStack, server: Server, model_dir: Path, out: Path, index: int, starts: int
) -> tuple[str, int, Start]:
    """Start ``server`` (vitserve ``starts`` times, the last one kept running in ``stack``): its
    URL, pid and start-up."""
    times, phases = [], []
    attempts = starts if server.settings is not None else 1
    for attempt in range(attempts):
        with contextlib.ExitStack() as once:
            live = once.enter_context(
                running(
                    server.argv,
                    lambda port: server.env(port, model_dir),
                    out / f"{server.key}.log",
                    ports=PORTS,
                    start=index,
                    name=server.key,
                )
            )
            times.append(live.ready_s)
            phases.append(load_breakdown(http_get(live.url + "/metrics")))
            rss = tree_memory_kib(live.process.pid)["VmRSS"]
            if attempt == attempts - 1:
                stack.enter_context(once.pop_all())
    load, warmup = (Spread.of(p.get(phase) for p in phases) for phase in ("load", "warmup"))
    return live.url, live.process.pid, Start(Spread.of(times), load, warmup, rss)


def _point(
    case: Case, c: int, repeat: int, argv: list[str], url: str, own: set[int], plan: Plan
) -> Point:
    check = busy_check(own, interval_s=1.0)
    before = batch_counters(http_get(url + "/metrics"))
    measured = hey.run(argv, wall_limit_s=plan.duration_s + 90)
    after = batch_counters(http_get(url + "/metrics"))
    batches = after[1] - before[1]
    return Point(
        case.server,
        case.images,
        c,
        repeat,
        measured.ok_rps,
        measured.ms(50),
        measured.ms(99),
        measured.not_ok,
        measured.error_count,
        check.busy,
        (after[0] - before[0]) / batches if batches else None,
    )
