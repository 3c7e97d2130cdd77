"""Four concurrent 15 MiB JSON bodies of nested arrays against a real server.

While the four are sent at once, /health/live is asked every 50 ms on its own connection; the
server's peak resident memory is reset before (``/proc/PID/clear_refs``) and read after. Used by
``test_json_bombs.py`` against the test model, and by hand against the shipped one::

    python -m tests.reliability.json_bombs                                  # the service as shipped
    python -m tests.reliability.json_bombs --max-json-values 1000000000     # the guard out of reach

Prints one JSON object: each body's status and seconds, liveness latencies, peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench import server_process
from bench.machine import tree_memory_kib

SIZE = 15 * 1024 * 1024
PORTS = range(18250, 18300)


def _filled(prefix: bytes, item: bytes, suffix: bytes) -> bytes:
    """``prefix + item,item,...,item + suffix`` of SIZE bytes (within one item)."""
    count = (SIZE - len(prefix) - len(suffix)) // (len(item) + 1)
    return prefix + b",".join([item] * count) + suffix


def bodies() -> list[tuple[str, str, bytes]]:
    """(name, route, body): four ways to spend memory with arrays that hold nothing or nearly."""
    predict = (b'{"images": [{"pixels": [', b"]}]}")
    return [
        ("/predict, empty arrays", "/predict", _filled(predict[0], b"[]", predict[1])),
        ("/predict, nested empty arrays", "/predict", _filled(predict[0], b"[[[]]]", predict[1])),
        ("/predict, one-pixel rows", "/predict", _filled(predict[0], b"[0]", predict[1])),
        (
            "/attention, empty arrays",
            "/attention",
            _filled(b'{"image": {"pixels": [', b"[]", b"]}}"),
        ),
    ]


def reset_peak_rss(pid: int) -> bool:
    """Make VmHWM start again from VmRSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(url: str, pid: int, poll_s: float = 0.05) -> dict[str, Any]:
    """Send the four bodies at once while polling liveness; statuses, latencies, peak RSS growth."""
    payloads = bodies()
    before = tree_memory_kib(pid)["VmRSS"] or 0
    peak_reset = reset_peak_rss(pid)
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    client.get(f"{url}/health/live").raise_for_status()
                except httpx.HTTPError as error:  # a timeout counts, at its full length
                    failures.append(f"{type(error).__name__}: {error}"[:200])
                latencies.append(time.perf_counter() - started)
                stop.wait(poll_s)

    def send(payload: tuple[str, str, bytes]) -> dict[str, Any]:
        name, route, body = payload
        started = time.perf_counter()
        with httpx.Client(timeout=120) as client:
            response = client.post(
                f"{url}{route}", content=body, headers={"Content-Type": "application/json"}
            )
        error = response.json().get("error", {}) if response.status_code >= 400 else {}
        return {
            "body": name,
            "bytes": len(body),
            "status": response.status_code,
            "code": error.get("code"),
            "seconds": round(time.perf_counter() - started, 3),
        }

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.3)  # a few quiet probes first
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(send, payloads))
    time.sleep(0.3)
    stop.set()
    poller.join()
    peak = tree_memory_kib(pid)["VmHWM"] or 0
    return {
        "answers": answers,
        "liveness_probes": len(latencies),
        "liveness_failures": failures,
        "liveness_max_ms": round(1000 * max(latencies), 1),
        "liveness_p50_ms": round(1000 * statistics.median(latencies), 1),
        "rss_before_mib": round(before / 1024, 1),
        "peak_rss_growth_mib": round((peak - before) / 1024, 1),
        "peak_reset": peak_reset,
    }


@contextmanager
def served(model_repository: str, **settings: object) -> Iterator[tuple[str, int]]:
    """``python -m service`` on a free port of 18250-18299 with ``settings`` (VITSERVE_*) over the
    defaults; yields (url, pid) once it is ready, and stops it after."""
    port = server_process.free_port(PORTS)
    env = {
        "VITSERVE_MODEL_REPOSITORY": model_repository,
        "VITSERVE_PORT": str(port),
        "VITSERVE_GRPC_PORT": "0",  # no gRPC listener: the default 8001 may be held by anything
        "VITSERVE_INTRA_OP_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "VITSERVE_LOG_LEVEL": "warning",
        **{f"VITSERVE_{key.upper()}": str(value) for key, value in settings.items()},
    }
    url = f"http://{server_process.HOST}:{port}"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "service.log"
        argv = [sys.executable, "-m", "service"]
        process = server_process.spawn(argv, server_process.clean_env(env), log)
        try:
            server_process.wait_ready(process, url, log, timeout_s=120, poll_s=0.1, name="server")
            yield url, process.pid
        finally:
            server_process.stop_process(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--max-json-values", type=int, default=None)
    args = parser.parse_args(argv)
    settings = {} if args.max_json_values is None else {"max_json_values": args.max_json_values}
    with served(args.model_repository, **settings) as (url, pid):
        result = measure(url, pid)
    print(json.dumps({"max_json_values": args.max_json_values, **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
