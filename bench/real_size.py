"""vitserve against plain FastAPI + onnxruntime, mosec and Triton at the real size: ViT-Ti/16 and
ViT-S/16 at 224 x 224 on real JPEG photos.

    python -m bench.real_size [--sizes tiny,small] [--seconds 12] [--repeats 3]
        [--servers vitserve,plain,plain-legacy,mosec,triton] [--anchor-workers 2]

The models are DeiT-tiny and DeiT-small as an imported Hugging Face DeiT checkpoint is served: the
same graphs with seeded random weights (bench/graphs.py's ``random_weight_model``, written by
bench/heavy_models.py; nothing downloaded) and a DeiT's preprocessing, resize-crop (shorter side 256,
bicubic, centre 224 x 224, ImageNet mean and std), which every server takes from the model's metadata
through service/contract's Preprocessor. Each server runs the same ONNX file, vitserve's export
(bench/contenders.py says how each is started), except ``plain-legacy``: the plain server on
``torch.onnx.export(dynamo=False)``'s graph of the same checkpoint at opset 17 (bench/graphs.py's
``legacy_graph``, with the same metadata), what a user who exports by hand serves. mosec and Triton
run ``--anchor-workers`` model processes or instances (the cores by default, as a user configures
them on this machine).

Requests carry one JPEG each: the photos scikit-learn and scikit-image ship, centre-cropped to 4:3
and resized to 640 x 480 (quality 90; repeat r sends photo r, every server the same), at c=1, 16
and 64; and a 4032 x 3024 upscale (bench/decode.py's phone photo) at ``--phone-levels``. Every point
is ``hey`` for ``--seconds``; each repeat measures every server at every level, the servers'
order reversed every other repeat; medians over the repeats. Each point records the CPU its server
used per image, split by process role (vitserve: front ends, engine; Triton: the C++ server, its
Python stub that decodes and runs the model; mosec: its Rust front end, the Python workers that
decode and run the model; plain: one process), and for vitserve the model's own time per image
(the engine's statistics: the wall time of its batches' model runs, so its CPU time and any time
it waited for a core). Peak RSS is each server's process tree's, at the end. Each repeat also
measures the machine's ceiling for the same photos and model, no HTTP (bench/inprocess.py's one
process per core at batch 1 and 16): what no server can beat.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from bench import hey
from bench.baselines.venvs import VenvError, ensure
from bench.compare import start_server
from bench.contenders import OIP_PNG, PNG, PREDICT, cores, servers
from bench.decode import centre_jpeg, phone_jpeg, sample_photos
from bench.graphs import legacy_graph, random_weight_model
from bench.heavy_models import write_heavy_model
from bench.inprocess import Ceiling
from bench.machine import CLOCK_TICKS, busy_check, descendants, parse_pid_stat, tree_memory_kib
from bench.payloads import oip_png_body, predict_body
from bench.real_size_report import PHONE, PHOTO, PHOTO_SIZE, SIZES, Point, RealSize
from bench.server_process import http_get
from bench.stats import alternated, fmt
from export.onnx_graphs import with_metadata
from export.repository import write_version
from service.contract.model_repository import CLASSIFIER_FILE, METADATA_KEY

LEGACY = "plain-legacy"
SERVERS = ("vitserve", "plain", LEGACY, "mosec", "triton")  # bench/contenders.py's keys
LEVELS = (1, 16, 64)
CEILING_BATCHES = (1, 16)
TIMEOUT_S = 120  # hey's per request: a heavy model's c=64 queue takes longer than its default 30 s


def photo_jpeg(photo: np.ndarray, size: tuple[int, int] = PHOTO_SIZE, quality: int = 90) -> bytes:
    """``photo``'s centre 4:3, resized to ``size`` (width, height; bicubic), as a JPEG."""
    return centre_jpeg(photo, size, quality)


def role(server: str, command: str) -> str:
    """The part a process of ``server``'s tree plays, from its command name (/proc/PID/comm)."""
    if server == "vitserve":
        if command.startswith("vitserve-engine"):
            return "engine"
        return "front end" if command.startswith("vitserve-front") else "supervisor"
    if server == "triton":
        return "front end" if command.startswith("tritonserver") else "decode + model"
    if server == "mosec":
        return "front end" if command == "mosec" else "decode + model"
    return "whole server"


def tree_stat(root: int) -> dict[int, tuple[str, int]]:
    """``root`` and every process under it: its command name and the CPU ticks it has used so far."""
    found = {}
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[pid] = parse_pid_stat(Path(f"/proc/{pid}/stat").read_text())
    return found


def cpu_by_role(
    server: str, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]
) -> dict[str, float]:
    """Seconds of CPU each role of ``server`` used between two :func:`tree_stat` readings (a
    process that started in between counts from 0)."""
    seconds: dict[str, float] = {}
    for pid, (command, ticks) in after.items():
        used = (ticks - before.get(pid, (command, 0))[1]) / CLOCK_TICKS
        key = role(server, command)
        seconds[key] = seconds.get(key, 0.0) + used
    return seconds


def model_run_s(statistics: str | None) -> float | None:
    """Seconds the model has run so far, from Triton's statistics JSON (``GET
    /v2/models/{name}/stats``): ``compute_infer`` of every batch (``batch_stats``), each batch once
    (a request's ``inference_stats`` counts its batch's time again for each request in it); None
    where there are none."""
    if not statistics:
        return None
    batches = [b for m in json.loads(statistics)["model_stats"] for b in m.get("batch_stats", [])]
    if not batches:
        return None
    return sum(int(b["compute_infer"]["ns"]) for b in batches) / 1e9


def metadata_document(version_dir: Path) -> dict:
    """The ``vitserve`` metadata document of ``version_dir``'s model.onnx."""
    proto = onnx.load(version_dir / CLASSIFIER_FILE, load_external_data=False)
    return json.loads({p.key: p.value for p in proto.metadata_props}[METADATA_KEY])


def write_variant(
    graph: onnx.ModelProto,
    of: Path,
    repo: Path,
    version: int = 1,
    candidate: bool = False,
    **changes: object,
) -> Path:
    """``graph``, another graph of the model of version directory ``of`` (another exporter, or
    quantized), as ``version`` of the same model name in ``repo``, with ``of``'s metadata (name,
    labels, input, preprocessing: what every server reads) less its attention graph, and with
    ``changes``; ``candidate``: the new version starts as the candidate of the one served
    (export/repository.py's ``write_version``). Returns its directory."""
    document = metadata_document(of)
    document.pop("onnxruntime_fusions", None)  # with_metadata counts the graph's own
    document.update(version=version, attention_graph=None, **changes)
    with_metadata(graph, document)
    shape = document["input"]
    dims = (shape["channels"], shape["height"], shape["width"])
    files = {CLASSIFIER_FILE: graph}
    name, labels = document["name"], document["labels"]
    return write_version(repo, name, version, files, labels, dims, True, candidate)


@dataclass(frozen=True)
class Plan:
    sizes: tuple[str, ...]
    levels: tuple[int, ...]
    phone_levels: tuple[int, ...]
    seconds: float
    repeats: int
    servers: tuple[str, ...] = SERVERS
    anchor_workers: int = field(
        default_factory=cores
    )  # mosec's model processes, Triton's instances

    @classmethod
    def for_run(cls, quick: bool) -> Plan:
        if quick:
            return cls(("tiny",), (1, 16), (16,), 2.0, 1)
        return cls(SIZES, LEVELS, (16,), 12.0, 3)


def _bodies(out: Path, files: dict[str, bytes]) -> dict[tuple[str, str], Path]:
    """The request file of each (body style, JPEG name)."""
    paths = {}
    for name, data in files.items():
        encoded = [base64.b64encode(data).decode("ascii")]
        for style, body in ((PREDICT, predict_body(encoded)), (OIP_PNG, oip_png_body(encoded))):
            paths[style, name] = out / f"body-{style}-{name}.json"
            paths[style, name].write_bytes(body)
    return paths


def run(out: Path, plan: Plan, command: str = "python -m bench.real_size") -> RealSize:
    """Write the models, start every server on each in turn, measure, stop them."""
    out.mkdir(parents=True, exist_ok=True)
    chosen = sample_photos()
    photos = {name: photo_jpeg(photo) for name, photo in chosen.items()}
    files = {**photos, PHONE: phone_jpeg(next(iter(chosen.values())))}
    bodies = _bodies(out, files)
    result = RealSize(list(plan.sizes), {}, plan.seconds, plan.repeats, list(photos))
    result.command = command
    for size in plan.sizes:
        model = random_weight_model(size)
        model_dir = write_heavy_model(
            size, out / "models" / size, geometry="resize-crop", model=model
        )
        legacy_dir = None
        if LEGACY in plan.servers:
            legacy_dir = write_variant(
                legacy_graph(model), model_dir, out / "models" / f"{size}-legacy"
            )
        plan_servers = []
        found = servers(model_dir, {}, model_workers=plan.anchor_workers, legacy_dir=legacy_dir)
        for server in found:
            if server.key not in plan.servers or server.key in result.missing:
                continue
            try:
                if server.venv:
                    ensure(server.venv, out / f"venv-{server.venv.name}.log")
                plan_servers.append(server)
            except VenvError as error:
                result.missing[server.key] = str(error)
        with contextlib.ExitStack() as stack:
            urls, pids, metrics = {}, {}, {}
            for index, server in enumerate(plan_servers):
                result.labels[server.key] = server.label
                result.commands.append(server.shown())
                url, pid, _ = start_server(stack, server, model_dir, out, index, 1)
                urls[server.key] = url + server.routes[PNG].path
                pids[server.key] = pid
                if server.settings is not None:  # vitserve: the model's time, from its statistics
                    metrics[server.key] = f"{url}/v2/models/{model_dir.parent.name}/stats"
            ceiling = Ceiling(
                model_dir, [base64.b64encode(data).decode() for data in photos.values()]
            )
            stack.callback(ceiling.close)
            keys = [s.key for s in plan_servers]
            style = {s.key: s.routes[PNG].body for s in plan_servers}
            for key in keys:  # warm: every session's first runs, every worker's first decode
                warm = hey.command(urls[key], bodies[style[key], PHONE], concurrency=4, requests=16)
                hey.run(warm, wall_limit_s=300)
            for repeat in range(plan.repeats):
                for batch in CEILING_BATCHES:
                    rate = ceiling.images_per_s(batch, min(plan.seconds, 5.0))
                    result.ceiling.setdefault(f"{size}/{batch}", []).append(rate)
                photo = list(photos)[repeat % len(photos)]
                work = [(PHOTO, c, photo) for c in plan.levels]
                work += [(PHONE, c, PHONE) for c in plan.phone_levels]
                for payload, c, name in work:
                    for key in alternated(keys, repeat):
                        argv = hey.command(
                            urls[key],
                            bodies[style[key], name],
                            concurrency=c,
                            duration_s=plan.seconds,
                            timeout_s=TIMEOUT_S,
                        )
                        point = _point(size, key, payload, c, repeat, argv, pids, metrics, plan)
                        result.points.append(point)
                        print(
                            f"  {size} r{repeat} {payload} c={c} {key}: {point.images_per_s:.1f} "
                            f"images/s p50 {fmt(point.p50_ms)} p99 {fmt(point.p99_ms)} "
                            f"failed {point.failed} cpu {point.cpu_ms} "
                            f"others {point.other_cores:.2f} cores",
                            flush=True,
                        )
            for key, pid in pids.items():
                peak = tree_memory_kib(pid)["VmHWM"]
                result.peak_mib[f"{size}/{key}"] = peak / 1024 if peak else None
    return result


def _point(
    size: str,
    key: str,
    payload: str,
    c: int,
    repeat: int,
    argv: list[str],
    pids: dict[str, int],
    statistics: dict[str, str],
    plan: Plan,
) -> Point:
    own = {p for pid in pids.values() for p in [pid, *descendants(pid)]}
    check = busy_check(own, interval_s=0.5)
    url = statistics.get(key)
    model_before = model_run_s(http_get(url)) if url else None
    before = tree_stat(pids[key])
    measured = hey.run(argv, wall_limit_s=plan.seconds + 120)
    cpu = cpu_by_role(key, before, tree_stat(pids[key]))
    model_after = model_run_s(http_get(url)) if url else None
    answered = measured.ok
    per_image = {r: 1000 * s / answered for r, s in cpu.items()} if answered else {}
    model_ms = (
        1000 * (model_after - model_before) / answered
        if answered and model_before is not None and model_after is not None
        else None
    )
    return Point(
        size,
        key,
        payload,
        c,
        repeat,
        measured.ok_rps,
        measured.ms(50),
        measured.ms(99),
        measured.not_ok + measured.error_count,
        per_image,
        model_ms,
        check.busy,
        check.other_cores,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_size", description=__doc__)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"of {','.join(SIZES)}")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument(
        "--phone-levels", default="16", help="levels of the 4032 x 3024 photo ('' for none)"
    )
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"of {','.join(SERVERS)}")
    parser.add_argument(
        "--anchor-workers",
        type=int,
        default=cores(),
        help="mosec's model processes and Triton's model instances (default: the cores)",
    )
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results-dir", type=Path, help="raw results (default: a temporary one)")
    args = parser.parse_args(argv)

    def numbers(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            parser.error(f"{text!r}: expected concurrency levels, e.g. 1,16,64")

    sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes {','.join(unknown)}: expected some of {','.join(SIZES)}")
    chosen = tuple(s.strip() for s in args.servers.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SERVERS]
    if unknown or not chosen:
        parser.error(f"--servers {args.servers!r}: expected some of {','.join(SERVERS)}")
    if args.anchor_workers < 1:
        parser.error("--anchor-workers must be 1 or more")
    plan = Plan(
        sizes,
        numbers(args.levels),
        numbers(args.phone_levels),
        args.seconds,
        args.repeats,
        chosen,
        args.anchor_workers,
    )
    out = args.results_dir or Path(tempfile.mkdtemp(prefix="real-size-"))
    given = argv if argv is not None else sys.argv[1:]
    shown = " ".join(["python -m bench.real_size", *([shlex.join(given)] if given else [])])
    result = run(out, plan, shown)
    raw = json.dumps(dataclasses.asdict(result), indent=1, default=str)
    (out / "real_size.json").write_text(raw)
    print(result.markdown())
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
