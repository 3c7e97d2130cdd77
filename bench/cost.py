"""What a request costs: vitserve against mosec (and, at c=1, the plain server) on the same model file
under ``wrk``, with the CPU of each server's whole process tree.
``python -m bench.cost [--rounds 2] [--seconds 15] [--levels 1,64,256] [--model-dir DIR]
[--also CHECKOUT ...]``.

One base64 PNG per request (a 28x28 Fashion-MNIST image; bench/payloads.py), each server started once
and kept up; each round runs every server at every level, the servers alternated (order reversed
every other round) so that drift falls on them alike; medians over the rounds. Per point: answered
(2xx) req/s, wrk's p50 and p99, the cores the server's process tree used while wrk ran, and so its
CPU milliseconds per answered request. The seam issue's targets (docs/decisions.md): vitserve's CPU
per request <= 1.1x mosec's; >= 1.15x mosec's req/s at c=64 and c=256 with a lower p99; c=1 p50
within 5% of the plain server's. Checked for other work on the machine first (bench/machine.py).
``--also`` serves another vitserve checkout (with its own ``.venv``, e.g. a worktree of the commit
before a change) beside the others, in the same alternation, under its directory's name: a change's
CPU per request, measured side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import wrk
from bench.baselines.venvs import VenvError, ensure
from bench.contenders import Server, servers
from bench.machine import busy_check, cores_used, process_tree
from bench.payloads import b64_pngs, predict_body
from bench.server_process import REPO, running
from bench.stats import alternated
from bench.targets import PNG

PORTS = range(18240, 18260)
SHIPPED = REPO / "models" / "fashion-mnist-vit" / "1"
COMPARED = ("vitserve", "mosec", "plain")
PLAIN_LEVELS = (1,)  # the plain server answers one request at a time: its reference is c=1


@dataclass(frozen=True)
class Point:
    server: str
    concurrency: int
    ok_rps: float
    p50_ms: float
    p99_ms: float
    cores: float
    not_ok: int
    socket_errors: int

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000.0 * self.cores / self.ok_rps if self.ok_rps else float("inf")


def measure(server: Server, url: str, pid: int, body: bytes, level: int, seconds: float) -> Point:
    before, start = process_tree(pid), time.monotonic()
    got = wrk.run(url + server.routes[PNG].path, body, level, seconds)
    cores = cores_used(before, process_tree(pid), time.monotonic() - start)
    return Point(
        server.key,
        level,
        got.ok_rps,
        1000 * got.percentiles_s.get(50, float("nan")),
        1000 * got.percentiles_s.get(99, float("nan")),
        cores,
        got.not_ok,
        got.socket_errors,
    )


def median_point(points: list[Point]) -> Point:
    first = points[0]
    return Point(
        first.server,
        first.concurrency,
        statistics.median(p.ok_rps for p in points),
        statistics.median(p.p50_ms for p in points),
        statistics.median(p.p99_ms for p in points),
        statistics.median(p.cores for p in points),
        sum(p.not_ok for p in points),
        sum(p.socket_errors for p in points),
    )


def report(medians: dict[tuple[str, int], Point], rounds: int, seconds: float) -> str:
    lines = [
        f"median of {rounds} alternated rounds, wrk -t1, {seconds:g} s a point, one base64 PNG a "
        "request",
        "",
        "| server | c | ok req/s | p50 ms | p99 ms | cores | CPU ms/request | not 2xx | socket errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in medians.values():
        lines.append(
            f"| {p.server} | {p.concurrency} | {p.ok_rps:.0f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} | "
            f"{p.cores:.2f} | {p.cpu_ms_per_request:.2f} | {p.not_ok} | {p.socket_errors} |"
        )
    lines += ["", "| target | measured | |", "|---|---|---|"]
    for level in sorted({c for _, c in medians}):
        ours, anchor = medians.get(("vitserve", level)), medians.get(("mosec", level))
        if ours is None or anchor is None:
            continue
        cpu = ours.cpu_ms_per_request / anchor.cpu_ms_per_request
        lines.append(
            f"| c={level}: CPU per request <= 1.1x mosec's | {cpu:.3f}x | "
            f"{'PASS' if cpu <= 1.1 else 'FAIL'} |"
        )
        if level > 1:
            rps = ours.ok_rps / anchor.ok_rps
            tail = ours.p99_ms < anchor.p99_ms
            lines.append(
                f"| c={level}: >= 1.15x mosec's req/s | {rps:.3f}x | "
                f"{'PASS' if rps >= 1.15 else 'FAIL'} |"
            )
            lines.append(
                f"| c={level}: lower p99 than mosec | {ours.p99_ms:.1f} vs "
                f"{anchor.p99_ms:.1f} ms | {'PASS' if tail else 'FAIL'} |"
            )
    ours, plain = medians.get(("vitserve", 1)), medians.get(("plain", 1))
    if ours is not None and plain is not None:
        ratio = ours.p50_ms / plain.p50_ms
        lines.append(
            f"| c=1: p50 within 5% of the plain server's | {ratio:.3f}x "
            f"({ours.p50_ms:.2f} vs {plain.p50_ms:.2f} ms) | "
            f"{'PASS' if ratio <= 1.05 else 'FAIL'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--levels", default="1,64,256")
    parser.add_argument("--model-dir", type=Path, default=SHIPPED)
    parser.add_argument("--servers", default=",".join(COMPARED))
    parser.add_argument("--also", type=Path, action="append", default=[], metavar="CHECKOUT")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.levels.split(","))
    wanted = args.servers.split(",")
    every = servers(args.model_dir.resolve(), {})
    plan = [s for s in every if s.key in wanted]
    ours = next(s for s in every if s.key == "vitserve")
    checkouts = {ours.key: REPO}
    for checkout in args.also:
        key = checkout.resolve().name
        checkouts[key] = checkout.resolve()
        python = str(checkout.resolve() / ".venv" / "bin" / "python")
        plan.append(replace(ours, key=key, argv=(python, *ours.argv[1:])))
    body = predict_body(b64_pngs(1)[0])
    busy = busy_check()
    if busy.busy:
        print(f"warning: the machine is busy: {busy.describe()}", file=sys.stderr)
    found: dict[tuple[str, int], list[Point]] = {}
    with tempfile.TemporaryDirectory(prefix="vitserve-cost-") as logs, contextlib.ExitStack() as up:
        started = []
        for index, server in enumerate(plan):
            try:
                if server.venv is not None:
                    ensure(server.venv, Path(logs) / f"{server.key}-venv.log")
            except VenvError as error:
                print(f"{server.key}: not measured ({error})", file=sys.stderr)
                continue
            running_server = up.enter_context(
                running(
                    server.argv,
                    lambda port, s=server: s.env(port, args.model_dir.resolve()),
                    Path(logs) / f"{server.key}.log",
                    ports=PORTS,
                    start=index,
                    name=server.key,
                    ready_path=server.ready_path,
                    cwd=checkouts.get(server.key, REPO),
                )
            )
            started.append((server, running_server))
        for round_index in range(args.rounds):
            for server, up_server in alternated(started, round_index):
                for level in levels:
                    if server.key == "plain" and level not in PLAIN_LEVELS:
                        continue
                    point = measure(
                        server, up_server.url, up_server.process.pid, body, level, args.seconds
                    )
                    found.setdefault((server.key, level), []).append(point)
                    print(f"round {round_index}: {point}", file=sys.stderr)
    print(report({k: median_point(v) for k, v in found.items()}, args.rounds, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
