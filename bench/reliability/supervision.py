"""Kill -9 under load: what a front end's death and the engine's death cost, and how soon it is back.

``python -m bench.reliability.supervision`` runs a service with two front ends under steady load
(``--clients`` threads posting one PNG each, new connection after any error), kills one front end, then
later the engine, and prints the requests each death lost (failed connections and 5xx), the 503s
answered while the engine was down, and the time from the kill to ready again. tests/reliability/
test_supervision.py runs the same scenarios, shorter, with the helpers here. Loopback only; bounded.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.machine import descendants
from bench.payloads import load_images, png_bytes
from bench.reliability.common import dump, service

ENGINE_NAME, FRONT_END_NAME = "vitserve-engine", "vitserve-front"  # service/launcher/processes.py


def state_of(pid: int) -> str | None:
    """A process's state letter (R, S, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def name_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (neither gone nor zombies)."""
    return [p for p in pids if state_of(p) not in (None, "Z")]


def engine_and_front_ends(supervisor: int) -> tuple[int | None, list[int]]:
    """The live engine's pid and the live front ends' pids, by process name."""
    live = alive(descendants(supervisor))
    engines = [p for p in live if name_of(p) == ENGINE_NAME]
    return (engines[0] if engines else None), sorted(
        p for p in live if name_of(p).startswith(FRONT_END_NAME)
    )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``condition`` until true; the seconds that took. AssertionError after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - started


class Load:
    """``clients`` threads posting ``png`` to /predict until the block ends (at most ``limit_s``)."""

    def __init__(self, url: str, png: bytes, clients: int = 4, limit_s: float = 120.0) -> None:
        self.url, self.png, self.clients, self.limit_s = url, png, clients, limit_s
        self.statuses: list[int] = []
        self.failures: list[str] = []
        # answers other than 200 and 503 with Retry-After, with their bodies
        self.unexpected: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    @property
    def answered(self) -> int:
        return self.statuses.count(200)

    @property
    def failed(self) -> int:
        return len(self.failures) + sum(1 for s in self.statuses if s >= 500 and s != 503)

    def _client(self) -> None:
        deadline = time.monotonic() + self.limit_s
        http = httpx.Client(base_url=self.url, timeout=30)
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                response = http.post("/predict", files={"files": ("a.png", self.png)})
                with self._lock:
                    self.statuses.append(response.status_code)
                    if response.status_code not in (200, 503) or (
                        response.status_code == 503 and not response.headers.get("Retry-After")
                    ):
                        self.unexpected.append(f"{response.status_code}: {response.text[:300]}")
            except httpx.HTTPError as error:
                with self._lock:
                    self.failures.append(f"{type(error).__name__}: {error}")
                http.close()
                http = httpx.Client(base_url=self.url, timeout=30)
        http.close()

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def ready(url: str) -> bool:
    """Whether ``/health/ready`` answers 200 (on a new connection); False when nothing answers."""
    try:
        return httpx.get(url + "/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def measure(clients: int, settle_s: float, workers: int) -> dict:
    png = png_bytes(load_images(1)[0][0])
    result: dict = {"clients": clients, "workers": workers}
    with service(Path("bench/results/supervision.log"), workers=workers) as server:
        supervisor = server.process.pid
        with Load(server.url, png, clients) as load:
            time.sleep(settle_s)
            before = (load.answered, load.failed, len(load.statuses))
            _, front_ends = engine_and_front_ends(supervisor)
            os.kill(front_ends[0], signal.SIGKILL)
            back = wait_for(
                lambda: (
                    front_ends[0] not in engine_and_front_ends(supervisor)[1]
                    and len(engine_and_front_ends(supervisor)[1]) == workers
                ),
                60,
                "a new front end",
            )
            time.sleep(settle_s)
            result["front_end_kill"] = {
                "requests_lost": load.failed - before[1],
                "answered_meanwhile": load.answered - before[0],
                "seconds_to_replacement": round(back, 3),
            }
            engine, _ = engine_and_front_ends(supervisor)
            before = (load.answered, load.failed, load.statuses.count(503))
            killed = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            not_ready = wait_for(lambda: not ready(server.url), 10, "readiness off")
            wait_for(lambda: ready(server.url), 120, "ready again")
            ready_again = time.monotonic() - killed
            time.sleep(settle_s)
            result["engine_kill"] = {
                "seconds_to_not_ready": round(not_ready, 3),
                "seconds_to_ready_again": round(ready_again, 3),
                "answered_503_meanwhile": load.statuses.count(503) - before[2],
                "requests_lost": load.failed - before[1],
            }
        result["zombies"] = [p for p in descendants(supervisor) if state_of(p) == "Z"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/supervision.json"))
    args = parser.parse_args()
    dump(measure(args.clients, args.settle_s, args.workers), args.out)


if __name__ == "__main__":
    main()
