"""What the reliability benches share: a service process they start and always stop, its memory, the
requests they send (good ones with known answers, and bad ones with their expected status).

Loopback only, ports 18200-18299 (docs/ARCHITECTURE.md). Every loop the benches run is bounded both in
time and in count.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.machine import tree_memory_kib
from bench.payloads import load_images, png_bytes
from bench.server_process import REPO, port_is_free, running, service_env

PORTS = range(18240, 18300)  # the upper part of the reliability range; the tests start lower


@dataclass
class Service:
    process: subprocess.Popen
    url: str
    log: Path
    health_port: int | None = None  # VITSERVE_HEALTH_PORT, when one was asked for

    def status(self, key: str) -> int:
        """A memory figure of the service's processes together, in bytes (VmRSS now, VmHWM the peak)."""
        kib = tree_memory_kib(self.process.pid)[key]
        if kib is None:
            raise RuntimeError(f"no {key} for process {self.process.pid}")
        return kib * 1024


@contextmanager
def service(log: Path, tmpdir: str | None = None, **settings: object) -> Iterator[Service]:
    """``nice -n 10 python -m service`` (one onnxruntime thread) on a free loopback port, ready;
    always stopped with SIGTERM (SIGKILL after 30 s) when the block ends, whatever happens in it.
    ``health_port="auto"`` gives it a health port too: another free port of the range; ``tmpdir``,
    its TMPDIR."""
    fixed = {
        "provider": "cpu",
        "intra_op_threads": 1,
        "inter_op_threads": 1,
        "log_level": "warning",
    }

    chosen: dict[str, object] = {**fixed, **settings}

    def env(port: int) -> dict[str, str]:
        if settings.get("health_port") == "auto":  # chosen once the HTTP port is: never the same
            chosen["health_port"] = next(
                p for p in reversed(PORTS) if p != port and port_is_free(p)
            )
        return {
            **service_env(port, **chosen),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            **({"TMPDIR": tmpdir} if tmpdir else {}),
        }

    argv = ("nice", "-n", "10", sys.executable, "-m", "service")
    with running(argv, env, log, ports=PORTS, poll_s=0.2, name="the service") as server:
        health = chosen.get("health_port")
        yield Service(server.process, server.url, log, int(health) if health else None)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass
class Payloads:
    """Garment images as PNG and pixels, and the answers a quiet service gave for them."""

    images: np.ndarray
    pngs: list[bytes]
    source: str
    expected: dict[int, int] = field(default_factory=dict)  # image index -> class index

    @classmethod
    def load(cls, count: int = 32) -> Payloads:
        images, source = load_images(count)
        return cls(images, [png_bytes(image) for image in images], source)

    def json_body(self, index: int) -> dict:
        return {"images": [{"b64": b64(self.pngs[index])}]}

    def learn_answers(self, url: str, headers: dict[str, str] | None = None) -> None:
        """Ask the quiet service once per image: the answers every later one must agree with."""
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            for index in range(len(self.pngs)):
                response = http.post("/predict", json=self.json_body(index))
                response.raise_for_status()
                self.expected[index] = response.json()["predictions"][0]["index"]


def bad_requests() -> list[tuple[str, dict, int]]:
    """(name, httpx request arguments, expected status): bad input the soak mixes in."""
    tiff = b"II*\x00" + b"\x00" * 64
    png = png_bytes(np.zeros((8, 8), np.uint8))
    return [
        ("invalid JSON", {"content": b"{", "headers": {"Content-Type": "application/json"}}, 422),
        ("bad base64", {"json": {"images": [{"b64": "!!"}]}}, 422),
        ("random bytes", {"json": {"images": [{"b64": b64(os.urandom(512))}]}}, 422),
        ("truncated PNG", {"json": {"images": [{"b64": b64(png[:30])}]}}, 422),
        ("TIFF", {"json": {"images": [{"b64": b64(tiff)}]}}, 415),
        ("ragged pixels", {"json": {"images": [{"pixels": [[1, 2], [3]]}]}}, 422),
        ("pixel 300", {"json": {"images": [{"pixels": [[300]]}]}}, 422),
        ("top_k 0", {"json": {"images": [{"pixels": [[1]]}], "top_k": 0}}, 422),
        ("text/plain", {"content": b"x", "headers": {"Content-Type": "text/plain"}}, 415),
        ("unknown field", {"json": {"images": [{"pixels": [[1]]}], "x": 1}}, 422),
    ]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def dump(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
