"""The kills-under-load probe (RELIABILITY.md): kill -9 of a front end twice and of the engine twice (the second time during
its own restart: its replacement is killed as soon as it runs) under ``--clients`` (16) for
``--duration-s`` (60 s), then SIGTERM.

``python -m bench.reliability.kills_under_load`` prints, and writes to ``--out``, what its target
asks: every answer other than 200 and 503 with Retry-After (there should be none), the requests lost
(connections a killed front end dropped), the seconds from each kill to ready again, the service's
memory (every process's VmRSS summed) before and after, its exit code, and what was left in /dev/shm and
in its TMPDIR (a fresh one) after SIGTERM. Ready again: every front end runs and is connected to the
engine (the engine's Unix socket's connections, from /proc/net/unix), and /health/ready answers 200 on
four new connections in a row (the kernel spreads them over the front ends). No health port: with one,
the supervisor runs a thread and spawns replacement front ends instead of forking them (slower;
docs/ARCHITECTURE.md). Loopback only; bounded.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from bench.payloads import load_images, png_bytes
from bench.reliability.common import dump, service
from bench.reliability.supervision import Load, engine_and_front_ends, ready, wait_for

BACK_WITHIN_S = 60.0  # how long a kill may take to recover before the probe gives up
LOG = Path("bench/results/kills_under_load.log")


def engine_connections(engine_socket: str) -> int:
    """Connections accepted on the engine's Unix socket (state 03, connected, with its path)."""
    with open("/proc/net/unix") as table:
        rows = [line.split() for line in list(table)[1:]]
    return sum(1 for row in rows if len(row) == 8 and row[7] == engine_socket and row[5] == "03")


class Probe:
    def __init__(self, supervisor: int, url: str, engine_socket: str, workers: int):
        self.supervisor, self.url = supervisor, url
        self.engine_socket, self.workers = engine_socket, workers

    def all_ready(self) -> bool:
        return (
            engine_connections(self.engine_socket) == self.workers
            and len(engine_and_front_ends(self.supervisor)[1]) == self.workers
            and all(ready(self.url) for _ in range(4))
        )

    def kill_front_end(self, index: int) -> dict:
        _, front_ends = engine_and_front_ends(self.supervisor)
        victim = front_ends[index % len(front_ends)]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: victim not in engine_and_front_ends(self.supervisor)[1], 10, "its end")
        wait_for(self.all_ready, BACK_WITHIN_S, "ready again")
        return {"killed": "front end", "seconds_to_ready": round(time.monotonic() - killed, 3)}

    def kill_engine(self, during_restart: bool) -> dict:
        engine, _ = engine_and_front_ends(self.supervisor)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        result: dict = {"killed": "engine"}
        if during_restart:
            wait_for(
                lambda: engine_and_front_ends(self.supervisor)[0] not in (None, engine),
                10,
                "its replacement",
            )
            replacement, _ = engine_and_front_ends(self.supervisor)
            result["replacement_ready_when_killed"] = ready(self.url)
            killed_again = time.monotonic()
            os.kill(replacement, signal.SIGKILL)
            result["killed"] = "engine, then its replacement while it loaded"
            result["seconds_between_kills"] = round(killed_again - killed, 3)
            killed = killed_again
        wait_for(lambda: not ready(self.url), 10, "not ready")
        wait_for(self.all_ready, BACK_WITHIN_S, "ready again")
        result["seconds_to_ready"] = round(time.monotonic() - killed, 3)
        return result


def measure(clients: int, duration_s: float, workers: int, log: Path = LOG) -> dict:
    tmpdir = tempfile.mkdtemp(
        prefix="kills-under-load-"
    )  # the service's: what it leaves is counted
    png = png_bytes(load_images(1)[0][0])
    result: dict = {"clients": clients, "duration_s": duration_s, "workers": workers}
    with service(log, tmpdir, workers=workers, log_level="info") as server:
        supervisor = server.process.pid
        (run_dir,) = (p for p in os.listdir(tmpdir) if p.startswith(f"vitserve-{supervisor}-"))
        probe = Probe(supervisor, server.url, os.path.join(tmpdir, run_dir, "engine"), workers)
        wait_for(probe.all_ready, BACK_WITHIN_S, "ready")
        memory = {"before_mib": round(server.status("VmRSS") / 2**20, 1)}
        schedule = [
            (0.12, lambda: probe.kill_front_end(0)),
            (0.30, lambda: probe.kill_engine(during_restart=False)),
            (0.50, lambda: probe.kill_front_end(1)),
            (0.68, lambda: probe.kill_engine(during_restart=True)),
        ]
        kills = []
        with Load(server.url, png, clients, limit_s=duration_s + BACK_WITHIN_S) as load:
            started = time.monotonic()
            for at, kill in schedule:
                time.sleep(max(0.0, started + at * duration_s - time.monotonic()))
                kills.append(kill())
            time.sleep(max(0.0, started + duration_s - time.monotonic()))
        memory["after_mib"] = round(server.status("VmRSS") / 2**20, 1)
        memory["peak_sum_mib"] = round(server.status("VmHWM") / 2**20, 1)
    statuses = load.statuses
    result.update(
        kills=kills,
        requests=len(statuses) + len(load.failures),
        answered_200=statuses.count(200),
        answered_503=statuses.count(503),
        unexpected_answers=load.unexpected[:20],
        requests_lost=len(load.failures),
        lost=sorted(set(load.failures))[:10],
        memory=memory,
        exit_code=server.process.returncode,
        left_in_dev_shm=[
            n for n in os.listdir("/dev/shm") if n.startswith(f"vitserve-{supervisor}-")
        ],
        left_in_tmpdir=sorted(os.listdir(tmpdir)),
    )
    if not result["left_in_tmpdir"]:
        os.rmdir(tmpdir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kills_under_load.json"))
    args = parser.parse_args()
    dump(measure(args.clients, args.duration_s, args.workers), args.out)


if __name__ == "__main__":
    main()
