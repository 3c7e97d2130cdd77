"""Health under a connection flood: probes while every connection the server allows is held.

    python -m bench.reliability.health_flood --seconds 60 --connections 512 \\
        --out bench/results/reliability-health-flood.json

Not under ``nice``: the service and the flood run at ``nice -n 10`` by themselves, the prober at the
default priority, as a kubelet would.

Starts ``python -m service`` (the shipped model) with ``VITSERVE_MAX_CONNECTIONS=--connections``,
then, in a child process (so that the flood's own event loop never delays a probe's timing):

- ``--busy`` keep-alive connections send one-image /predict requests back to back;
- the rest of the cap is held by idle connections, each closed and re-opened every few seconds;
- ``--extra`` more connections keep knocking past the cap (each answered 503 and closed: expected);

while this process opens a fresh connection every ``--probe-interval-s`` and GETs /health/live,
/health/ready, /v2/health/live and /v2/health/ready in turn, timing each from connect to the last
byte, alternately on the main port (past the cap) and on ``VITSERVE_HEALTH_PORT`` (answered by the
supervisor process: service/launcher/health.py). Reports probe p50/p99/max and statuses per port,
the busy clients' statuses, the knockers' refusals, and the RSS of the server's processes together
(the supervisor, the engine and the front ends: ``bench.machine.tree_memory_kib``) before and at
its peak (the sum of their VmHWM, which bounds their peak together from above), and the machine's
load average at the start and the end. Exits 1 when a promise broke: a probe not 200, a
health-port probe p99 of ``--p99-ms`` or more, a 5xx to a busy client, or RSS growth of
``--rss-mib`` or more.
Loopback only; every loop stops at its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

from bench.reliability.common import Payloads, b64, dump, percentile, service

PROBES = ("/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready")
# a /predict the server has not answered in this long is counted unanswered and its connection
# dropped, so that one lost answer ends the flood on time with a count instead of hanging it
ANSWER_TIMEOUT_S = 20.0
MiB = 2**20


async def _read_answer(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def _flood(
    port: int, connections: int, busy: int, extra: int, seconds: float, body: bytes
) -> dict:
    deadline = time.monotonic() + seconds
    statuses: dict[str, int] = {}
    refused = errors = unanswered = 0
    request = (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )

    async def busy_client() -> None:
        nonlocal errors, unanswered
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                while time.monotonic() < deadline:
                    writer.write(request)
                    async with asyncio.timeout(ANSWER_TIMEOUT_S):
                        status = await _read_answer(reader)
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                writer.close()
            except TimeoutError:
                unanswered += 1
                writer.close()
            except (OSError, asyncio.IncompleteReadError):
                errors += 1
                await asyncio.sleep(0.05)

    async def idle_client(number: int) -> None:
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                await asyncio.sleep(min(2.0 + number % 5, max(0.0, deadline - time.monotonic())))
                writer.close()
            except OSError:
                await asyncio.sleep(0.05)

    async def knocker() -> None:
        nonlocal refused
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n")
                refused += (await _read_answer(reader)) == 503
                writer.close()
            except (OSError, asyncio.IncompleteReadError):
                pass
            await asyncio.sleep(0.2)

    tasks = [busy_client() for _ in range(busy)]
    tasks += [idle_client(n) for n in range(connections - busy)]
    tasks += [knocker() for _ in range(extra)]
    await asyncio.gather(*tasks)
    return {
        "busy_statuses": statuses,
        "busy_transport_errors": errors,
        "busy_unanswered": unanswered,
        "knocks_refused": refused,
    }


def _flood_process(queue: multiprocessing.Queue, *args: object) -> None:
    os.nice(10)  # like the server: the prober alone keeps the default priority
    queue.put(asyncio.run(_flood(*args)))  # type: ignore[arg-type]


def probe(port: int, path: str) -> tuple[int, float]:
    """(status, seconds) of one GET on a fresh connection; status 0 when it failed."""
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.settimeout(10)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while piece := sock.recv(65536):
                data += piece
        return int(data.split(b" ", 2)[1]), time.perf_counter() - started
    except (OSError, IndexError, ValueError):
        return 0, time.perf_counter() - started


def run(
    connections: int, busy: int, extra: int, seconds: float, interval_s: float, log: Path
) -> dict:
    payloads = Payloads.load(8)
    body = json.dumps({"images": [{"b64": b64(payloads.pngs[0])}]}).encode()
    settings = {"max_connections": connections, "max_queue_size": 4 * connections}
    load_before = os.getloadavg()
    with service(log, health_port="auto", **settings) as server:
        port = int(server.url.rsplit(":", 1)[1])
        health_port = server.health_port
        assert health_port is not None
        rss_before = server.status("VmRSS")
        # spawned, not forked: a fork of a process that runs gRPC's threads (a test's clients) can
        # hang in the child, which then never reports
        spawn = multiprocessing.get_context("spawn")
        queue: multiprocessing.Queue = spawn.Queue()
        flood = spawn.Process(
            target=_flood_process, args=(queue, port, connections, busy, extra, seconds, body)
        )
        flood.start()
        time.sleep(min(2.0, seconds / 4))  # the flood fills the cap
        ports = {"main": port, "health": health_port}
        latencies: dict[str, list[float]] = {name: [] for name in ports}
        statuses: dict[str, dict[str, int]] = {name: {} for name in ports}
        end = time.monotonic() + seconds - min(2.0, seconds / 4)
        count = 0
        while time.monotonic() < end:
            name = ("main", "health")[count % 2]
            status, elapsed = probe(ports[name], PROBES[count // 2 % len(PROBES)])
            count += 1
            latencies[name].append(elapsed)
            statuses[name][str(status)] = statuses[name].get(str(status), 0) + 1
            time.sleep(max(0.0, interval_s - elapsed))
        flooded = queue.get(timeout=seconds + 60)
        flood.join(timeout=30)
        peak = server.status("VmHWM")
    return {
        "connections": connections,
        "busy": busy,
        "extra": extra,
        "seconds": seconds,
        "probes": count,
        **{
            f"{name}_{key}": value
            for name, times in latencies.items()
            for key, value in {
                "statuses": statuses[name],
                "p50_ms": 1000 * (percentile(times, 50) or 0),
                "p99_ms": 1000 * (percentile(times, 99) or 0),
                "max_ms": 1000 * max(times, default=0),
            }.items()
        },
        "rss_before_mib": rss_before / MiB,
        "rss_peak_mib": peak / MiB,
        "rss_growth_mib": (peak - rss_before) / MiB,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **flooded,
    }


def problems(result: dict, p99_ms: float, rss_mib: float) -> list[str]:
    found = []
    for name in ("main", "health"):
        if set(result[f"{name}_statuses"]) != {"200"}:
            found.append(f"probes on the {name} port answered {result[f'{name}_statuses']}")
    if result["health_p99_ms"] >= p99_ms:
        found.append(f"health-port probe p99 {result['health_p99_ms']:.1f} ms >= {p99_ms} ms")
    if any(status.startswith("5") for status in result["busy_statuses"]):
        found.append(f"busy clients got {result['busy_statuses']}")
    if result.get("busy_unanswered"):
        found.append(
            f"{result['busy_unanswered']} /predict requests unanswered after {ANSWER_TIMEOUT_S:g} s"
        )
    if result["rss_growth_mib"] >= rss_mib:
        found.append(f"RSS grew {result['rss_growth_mib']:.0f} MiB >= {rss_mib} MiB")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--connections", type=int, default=512, help="VITSERVE_MAX_CONNECTIONS")
    parser.add_argument("--busy", type=int, default=32, help="connections sending /predict")
    parser.add_argument("--extra", type=int, default=32, help="connections knocking past the cap")
    parser.add_argument("--probe-interval-s", type=float, default=0.1)
    parser.add_argument("--p99-ms", type=float, default=100.0)
    parser.add_argument("--rss-mib", type=float, default=200.0)
    parser.add_argument(
        "--log", type=Path, default=Path("bench/results/reliability-health-flood.log")
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    result = run(
        args.connections, args.busy, args.extra, args.seconds, args.probe_interval_s, args.log
    )
    result["problems"] = problems(result, args.p99_ms, args.rss_mib)
    dump(result, args.out)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
