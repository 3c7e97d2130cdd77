"""vitserve against the servers a user would run instead, and against the anchors (mosec, Triton),
over HTTP under ``hey``, in one run; at c=1 one client sends to every server in turn, half a second
each, every request timed to the microsecond (bench/one_client.py). Who and with what: bench/contenders.py.

Each repeat measures every case at every concurrency level, the cases alternated (order reversed every
other repeat) so that drift hits them alike, and the in-process ceiling (bench/inprocess.py) at each
batch size; medians over the repeats. Each point also records the cores the server's whole process
tree used while it ran; each server its spawn-to-ready time and the memory of its whole process tree.
Before each run the machine is checked for other work (bench/machine.py). An anchor whose venv cannot
be made (bench/baselines/venvs.py) is reported as not measured; the rest still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench import hey, one_client
from bench.baselines.classifier import Classifier
from bench.baselines.venvs import VenvError, ensure
from bench.comparison import Comparison, Point, Start
from bench.contenders import LEVELS, OIP_PNG, OIP_TENSOR, PNG, PREDICT, Case, Server, cases, servers
from bench.hey import HeyResult
from bench.inprocess import Ceiling
from bench.machine import busy_check, cores_used, process_tree, tree_memory_kib
from bench.payloads import b64_pngs, oip_png_body, oip_tensor_body, predict_body
from bench.server_process import http_get, running
from bench.stats import Spread, alternated

PORTS = range(18110, 18140)


def load_breakdown(metrics: str | None) -> dict[str, float]:
    """Seconds per start-up phase from ``vitserve_model_load_seconds`` (summed over models)."""
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics or ""):
        if family.name == "vitserve_model_load_seconds":
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                phases[phase] = phases.get(phase, 0.0) + sample.value
    return phases


def batch_counters(
    metrics: str | None, histogram: str = "vitserve_batch_size"
) -> tuple[float, float]:
    """(images, batches) the classifier has run so far, from the server's batch-size ``histogram``
    (vitserve's, or mosec's, which counts requests: here each of one image)."""
    images = batches = 0.0
    for family in text_string_to_metric_families(metrics or ""):
        if family.name == histogram:
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
            return cls((64,), 2.0, 1, 1, (32,), 0.5, 40, 240.0)
        return cls(LEVELS, 12.0, 3, 3, (1, 8, 32, 64), 2.0, 300, 1800.0)


def write_bodies(
    out: Path, model_dir: Path, encoded: list[str], needed: set[tuple[str, int]]
) -> dict[tuple[str, int], Path]:
    """The request files of ``needed``: (body style, images per request)."""
    classifier = Classifier(model_dir)
    meta = classifier.metadata
    makers = {
        PREDICT: lambda n: predict_body(encoded[:n]),
        OIP_PNG: lambda n: oip_png_body(encoded[:n]),
        OIP_TENSOR: lambda n: oip_tensor_body(
            np.stack([classifier.tensor(e) for e in encoded[:n]]),
            meta.input.name,
            meta.outputs.logits,
        ),
    }
    paths = {}
    for style, images in sorted(needed):
        paths[style, images] = out / f"body-{style}-{images}.json"
        paths[style, images].write_bytes(makers[style](images))
    return paths


def run(
    out: Path, model_dir: Path, plan: Plan, variants: dict[str, dict[str, str]] | None = None
) -> Comparison:
    """Start every server, measure, stop them; raw files (bodies, logs) go to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    encoded, source = b64_pngs(32)
    plan_servers, missing = [], {}
    for server in servers(model_dir, variants or {}):
        try:
            if server.venv:
                ensure(server.venv, out / f"venv-{server.venv.name}.log")
            plan_servers.append(server)
        except VenvError as error:
            print(f"  {server.key}: not measured: {error}", flush=True)
            missing[server.key] = str(error)
    result = Comparison(
        {s.key: s.label for s in plan_servers}, plan.duration_s, plan.repeats, source
    )
    result.missing = missing
    started = time.monotonic()  # the budget counts from here: making a venv is not measuring
    work = cases(plan_servers, plan.levels)
    by_key = {s.key: s for s in plan_servers}
    needed = {(by_key[case.server].routes[case.kind].body, case.images) for case in work}
    bodies = write_bodies(out, model_dir, encoded, needed)
    with contextlib.ExitStack() as stack:
        urls, pids = {}, {}
        for index, server in enumerate(plan_servers):
            result.commands.append(server.shown())
            url, pid, start = start_server(stack, server, model_dir, out, index, plan.starts)
            urls[server.key], pids[server.key], result.starts[server.key] = url, pid, start
        ceiling = Ceiling(model_dir, encoded)
        stack.callback(ceiling.close)
        result.ceiling_processes = len(ceiling.processes)

        def request(case: Case, concurrency: int, **amount: float) -> list[str]:
            route = by_key[case.server].routes[case.kind]
            return hey.command(
                urls[case.server] + route.path,
                bodies[route.body, case.images],
                concurrency=concurrency,
                **amount,
            )

        for case in work:
            hey.run(request(case, 8, requests=plan.warm_requests), wall_limit_s=120)
        for repeat in range(plan.repeats):
            for batch in plan.ceiling_batches:
                result.ceiling.setdefault(batch, []).append(
                    ceiling.images_per_s(batch, plan.ceiling_s)
                )
            for c in plan.levels:
                order = alternated([case for case in work if c in case.levels], repeat)
                own = {p for pid in pids.values() for p in process_tree(pid)} | ceiling.pids
                if c == 1:  # every case in turn (bench/one_client.py)
                    targets = [_target(case, urls, by_key, bodies) for case in order]
                    points = _one_at_a_time(order, targets, repeat, urls, pids, own, by_key, plan)
                    result.points += points
                    print("".join(f"  r{repeat} {point}\n" for point in points), end="", flush=True)
                    continue
                for case in order:
                    if time.monotonic() - started > plan.budget_s:
                        result.skipped += 1
                        continue
                    argv = request(case, c, duration_s=plan.duration_s)
                    if repeat == 0 and (c == plan.levels[-1] or case.kind != PNG):
                        result.commands.append(hey.shown(argv))
                    point = _point(
                        case, by_key[case.server], c, repeat, argv, urls, pids, own, plan
                    )
                    result.points.append(point)
                    print(f"  r{repeat} {point}", flush=True)
        for key, pid in pids.items():
            peak = tree_memory_kib(pid)["VmHWM"]
            result.starts[key] = dataclasses.replace(result.starts[key], peak_kib=peak)
    return result


def start_server(
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
                    ready_path=server.ready_path,
                )
            )
            times.append(live.ready_s)
            phases.append(load_breakdown(http_get(live.url + "/metrics")))
            rss = tree_memory_kib(live.process.pid)["VmRSS"]
            if attempt == attempts - 1:
                stack.enter_context(once.pop_all())
    load, warmup = (Spread.of(p.get(phase) for p in phases) for phase in ("load", "warmup"))
    return live.url, live.process.pid, Start(Spread.of(times), load, warmup, rss)


def _target(
    case: Case, urls: dict[str, str], by_key: dict[str, Server], bodies: dict[tuple[str, int], Path]
) -> tuple[str, bytes]:
    route = by_key[case.server].routes[case.kind]
    return urls[case.server] + route.path, bodies[route.body, case.images].read_bytes()


def _one_at_a_time(
    cases: list[Case],
    targets: list[tuple[str, bytes]],
    repeat: int,
    urls: dict[str, str],
    pids: dict[str, int],
    own: set[int],
    by_key: dict[str, Server],
    plan: Plan,
) -> list[Point]:
    """The c=1 points: every case in turn, half a second each, ``duration_s`` a case in all, so
    that the machine's drift falls on them alike. A case's cores are its server's process tree's CPU
    during that case's own turns over the time its requests took."""
    check = busy_check(own, interval_s=1.0)
    counted = [_batches(urls[case.server], by_key[case.server]) for case in cases]
    cpu_s, at_start = [0.0] * len(cases), [{}] * len(cases)

    def on_turn(index: int, starting: bool) -> None:
        ticks = process_tree(pids[cases[index].server])
        if starting:
            at_start[index] = ticks
        else:  # seconds of CPU: cores over one second
            cpu_s[index] += cores_used(at_start[index], ticks, 1.0)

    measured = one_client.alternate(targets, plan.duration_s * len(cases), on_turn=on_turn)
    return [
        _to_point(
            case,
            1,
            repeat,
            got,
            check.busy,
            counted[index],
            _batches(urls[case.server], by_key[case.server]),
            cpu_s[index] / got.total_s if got.total_s else None,
        )
        for index, (case, got) in enumerate(zip(cases, measured, strict=True))
    ]


def _point(
    case: Case,
    server: Server,
    c: int,
    repeat: int,
    argv: list[str],
    urls: dict[str, str],
    pids: dict[str, int],
    own: set[int],
    plan: Plan,
) -> Point:
    check = busy_check(own, interval_s=1.0)
    before = _batches(urls[case.server], server)
    ticks, began = process_tree(pids[case.server]), time.monotonic()
    measured = hey.run(argv, wall_limit_s=plan.duration_s + 90)
    cores = cores_used(ticks, process_tree(pids[case.server]), time.monotonic() - began)
    after = _batches(urls[case.server], server)
    return _to_point(case, c, repeat, measured, check.busy, before, after, cores)


def _batches(url: str, server: Server) -> tuple[float, float]:
    """(images, batches) the server's model has run so far; (0, 0) for a server that says not."""
    histogram = server.batch_histogram
    return batch_counters(http_get(url + "/metrics"), histogram) if histogram else (0.0, 0.0)


def _to_point(
    case: Case,
    c: int,
    repeat: int,
    measured: HeyResult,
    busy: bool,
    before: tuple[float, float],
    after: tuple[float, float],
    cores: float | None,
) -> Point:
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
        busy,
        (after[0] - before[0]) / batches if batches else None,
        case.kind,
        cores,
    )
