"""A live model update under load.

The model repository is copied to a temporary directory and the service started on it with
``VITSERVE_MODEL_CONTROL=poll`` and ``VITSERVE_REPOSITORY_POLL_S=0.5``. ``hey`` sends c=64 single-image
requests in three back-to-back windows: before, during and after the swap. One second into the second
window, a copy of the newest version, staged on the same file system, is renamed into
``<repository>/<model>/<version + 1>/``. Meanwhile a probe sends one request at a time and records the
status and ``model.version`` of each answer. Reported: failed requests (non-200 answers and transport
errors of the load and the probe; target 0), p99 of each window, and when the answers switched.
Run alone: ``python -m bench --only swap``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import hey
from bench.payloads import b64_pngs, predict_body
from bench.server_process import running_service
from bench.stats import fmt, table
from service.contract.model_repository import version_numbers

PORTS = range(18150, 18160)
POLL_S = 0.5


@dataclass(frozen=True)
class Probe:
    t: float  # seconds since the rename (negative before it)
    status: int  # 0: no HTTP answer (refused, reset, timed out)
    version: int | None


@dataclass(frozen=True)
class Switch:
    first_new_s: float | None  # the first answer from the new version, seconds after the rename
    last_old_s: float | None  # the last answer from the old version
    back_to_old: int  # answers from the old version after one from the new: 0 for a clean switch
    failed: int  # probe requests without a 200 answer


def analyse(probes: list[Probe], old: int, new: int) -> Switch:
    """When the answers went from version ``old`` to ``new``, and whether they went back."""
    ordered = sorted(probes, key=lambda p: p.t)
    new_times = [p.t for p in ordered if p.status == 200 and p.version == new]
    old_times = [p.t for p in ordered if p.status == 200 and p.version == old]
    first_new = new_times[0] if new_times else None
    back = sum(1 for t in old_times if first_new is not None and t > first_new)
    failed = sum(1 for p in ordered if p.status != 200)
    return Switch(first_new, old_times[-1] if old_times else None, back, failed)


@dataclass(frozen=True)
class Window:
    name: str
    seconds: float
    ok: int
    not_ok: int
    errors: int
    p99_ms: float | None

    @classmethod
    def of(cls, name: str, result: hey.HeyResult) -> Window:
        return cls(
            name, result.total_s, result.ok, result.not_ok, result.error_count, result.ms(99)
        )


@dataclass(frozen=True)
class Phases:
    before_s: float
    during_s: float
    after_s: float
    rename_after_s: float = 1.0
    concurrency: int = 64

    @classmethod
    def for_run(cls, quick: bool) -> Phases:
        return cls(2.0, 4.0, 1.0) if quick else cls(8.0, 10.0, 5.0)


@dataclass(frozen=True)
class Swap:
    old: int
    new: int
    windows: list[Window]
    switch: Switch
    probes: int
    commands: list[str]

    @property
    def failed(self) -> int:
        return sum(w.not_ok + w.errors for w in self.windows) + self.switch.failed

    @property
    def passed(self) -> bool:
        s = self.switch
        return self.failed == 0 and s.first_new_s is not None and s.back_to_old == 0

    def markdown(self) -> str:
        s = self.switch
        switched = (
            f"the first answer from version {self.new} came {s.first_new_s:.2f} s after the rename"
            if s.first_new_s is not None
            else f"**no answer ever came from version {self.new}**"
        )
        last_old = "-" if s.last_old_s is None else f"{s.last_old_s:.2f} s"
        rows = [
            [w.name, fmt(w.seconds, 1), str(w.ok), str(w.not_ok), str(w.errors), fmt(w.p99_ms, 1)]
            for w in self.windows
        ]
        return "\n".join(
            [
                "## Live model update under load",
                "",
                f"Version {self.old} -> {self.new} renamed into the repository during c=64 "
                f"single-image load (repository poll {POLL_S:g} s). **{self.failed} failed "
                f"requests** (target 0): **{'PASS' if self.passed else 'FAIL'}**. Probe "
                f"({self.probes} sequential requests): {switched}; the last from version "
                f"{self.old} at {last_old}; {s.back_to_old} answer(s) from version {self.old} "
                "after the first from the new one.",
                "",
                table(["window", "s", "200", "non-200", "errors", "p99 ms"], rows),
                "",
                "Commands:",
                "",
                *(f"- `{command}`" for command in self.commands),
            ]
        )


def stage(model_dir: Path, staging: Path) -> tuple[int, int, Callable[[], None]]:
    """Copy the newest version of ``model_dir`` under ``staging`` (same file system, not yet
    visible): that version, the new version number, and the rename that publishes it."""
    old = max(version_numbers(model_dir))
    staged = staging / str(old + 1)
    shutil.copytree(model_dir / str(old), staged)
    return old, old + 1, lambda: os.rename(staged, model_dir / str(old + 1))


def probe(
    url: str, body: bytes, stop: threading.Event, probes: list[tuple[float, int, int | None]]
):
    """One request at a time until ``stop``: (monotonic time, status, model version)."""
    while not stop.is_set():
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        status, version = 0, None
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                status, version = answer.status, json.load(answer)["model"]["version"]
        except urllib.error.HTTPError as error:
            status = error.code
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            status = 0
        probes.append((time.monotonic(), status, version))
        time.sleep(0.02)


def run(out: Path, model_dir: Path, phases: Phases) -> Swap:
    out.mkdir(parents=True, exist_ok=True)
    body = predict_body(b64_pngs(1)[0])
    (out / "body-1.json").write_bytes(body)
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-swap-") as tmp:
        repository = Path(tmp) / "models"
        shutil.copytree(model_dir.parents[1], repository)
        (Path(tmp) / "staging").mkdir()
        old, new, publish = stage(repository / model_dir.parent.name, Path(tmp) / "staging")
        settings = {
            "model_repository": repository,
            "model_control": "poll",
            "repository_poll_s": POLL_S,
        }
        raw: list[tuple[float, int, int | None]] = []
        stop = threading.Event()
        with running_service(out / "swap-service.log", ports=PORTS, **settings) as server:
            url = server.url + "/predict"
            hey.run(hey.command(url, out / "body-1.json", concurrency=8, requests=200), 120)
            prober = threading.Thread(target=probe, args=(url, body, stop, raw), daemon=True)
            prober.start()

            def load(seconds: float) -> list[str]:
                return hey.command(
                    url, out / "body-1.json", concurrency=phases.concurrency, duration_s=seconds
                )

            before = hey.run(load(phases.before_s), phases.before_s + 90)
            during = hey.start(load(phases.during_s))
            time.sleep(phases.rename_after_s)
            renamed_at = time.monotonic()
            publish()
            during_result = hey.finish(during, phases.during_s + 90)
            after = hey.run(load(phases.after_s), phases.after_s + 90)
            stop.set()
            prober.join(timeout=40)
    probes = [Probe(t - renamed_at, status, version) for t, status, version in raw]
    windows = [
        Window.of("before", before),
        Window.of("during", during_result),
        Window.of("after", after),
    ]
    shown = " ".join(
        f"VITSERVE_{k.upper()}={v}" for k, v in settings.items() if k != "model_repository"
    )
    commands = [f"{shown} python -m service", hey.shown(load(phases.during_s)).replace(url, "URL")]
    return Swap(old, new, windows, analyse(probes, old, new), len(probes), commands)
