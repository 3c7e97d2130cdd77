"""Run Debian's ``hey`` (github.com/rakyll/hey, 0.1.4) and parse its summary.

hey counts every answered request in ``Requests/sec`` (errors too) and computes its percentiles over
every answer whatever its status (503s included); transport errors (refused, reset, timed out) are only
in its error distribution. So ``ok_rps`` is recomputed: 200 answers per second of the run's total time.
A percentile hey has too few answers for is printed as ``0% in 0.0000 secs``: missing, not 0 ms.

hey runs with ``GOMAXPROCS=1`` (one OS thread, as ``wrk -t1``), so that on a small machine the load
generator takes at most one core from the server under test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ENV = {"GOMAXPROCS": "1"}


class HeyError(RuntimeError):
    pass


@dataclass(frozen=True)
class HeyResult:
    total_s: float
    rps: float  # hey's own: every answered request and every error, per second
    average_s: float | None
    percentiles_s: dict[int, float] = field(default_factory=dict)
    status_codes: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.status_codes.get(200, 0)

    @property
    def not_ok(self) -> int:
        return sum(self.status_codes.values()) - self.ok

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def ok_rps(self) -> float:
        return self.ok / self.total_s if self.total_s > 0 else 0.0

    def ms(self, percentile: int) -> float | None:
        seconds = self.percentiles_s.get(percentile)
        return None if seconds is None else seconds * 1000


def _number(pattern: str, text: str) -> float | None:
    match = re.search(pattern + r"\s+([0-9.]+|NaN)", text)
    return None if not match or match.group(1) == "NaN" else float(match.group(1))


def _section(text: str, title: str) -> list[str]:
    """The lines under ``title:`` up to the next blank line."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.strip() == f"{title}:":
            body = []
            for following in lines[index + 1 :]:
                if not following.strip():
                    break
                body.append(following.strip())
            return body
    return []


def parse_summary(text: str) -> HeyResult:
    """Parse hey's default (not CSV) output."""
    total, rps = _number(r"Total:", text), _number(r"Requests/sec:", text)
    if total is None or rps is None:
        raise HeyError(f"not a hey summary (no Total / Requests/sec):\n{text[:2000]}")
    percentiles = {}
    for line in _section(text, "Latency distribution"):
        match = re.fullmatch(r"([0-9]+)%\s+in\s+([0-9.]+)\s+secs", line)
        if match and int(match.group(1)) > 0:  # "0% in 0.0000 secs": too few answers for it
            percentiles[int(match.group(1))] = float(match.group(2))
    status_codes = {}
    for line in _section(text, "Status code distribution"):
        if match := re.fullmatch(r"\[([0-9]+)\]\s+([0-9]+)\s+responses", line):
            status_codes[int(match.group(1))] = int(match.group(2))
    errors: dict[str, int] = {}
    for line in _section(text, "Error distribution"):
        if match := re.fullmatch(r"\[([0-9]+)\]\s+(.*)", line):
            errors[match.group(2)] = errors.get(match.group(2), 0) + int(match.group(1))
    return HeyResult(total, rps, _number(r"Average:", text), percentiles, status_codes, errors)


def command(
    url: str,
    body: Path,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    timeout_s: int = 30,
) -> list[str]:
    """A fixed-duration (``-z``) or fixed-count (``-n``) POST of a JSON file."""
    if (duration_s is None) == (requests is None):
        raise ValueError("give exactly one of duration_s or requests")
    amount = ["-z", f"{duration_s:g}s"] if duration_s is not None else ["-n", str(requests)]
    return [
        *("hey", *amount, "-c", str(concurrency), "-t", str(timeout_s)),
        *("-m", "POST", "-T", "application/json", "-D", str(body), url),
    ]


def start(argv: list[str], threads: int = 1) -> subprocess.Popen:
    """hey in the background (its summary on stdout), for runs something else happens during;
    ``threads`` OS threads (``GOMAXPROCS``): more only where the server has many cores."""
    if shutil.which(argv[0]) is None:
        raise HeyError("hey is not installed (Debian: apt-get install hey)")
    env = {**os.environ, **ENV, "GOMAXPROCS": str(threads)}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(process: subprocess.Popen, wall_limit_s: float) -> HeyResult:
    try:
        out, err = process.communicate(timeout=wall_limit_s)
    except subprocess.TimeoutExpired as error:
        process.kill()
        process.communicate()
        raise HeyError(f"hey ran past {wall_limit_s:.0f} s: {' '.join(process.args)}") from error
    if process.returncode != 0:
        raise HeyError(f"hey exited {process.returncode}: {err.strip()[:500]}")
    return parse_summary(out)


def run(argv: list[str], wall_limit_s: float, threads: int = 1) -> HeyResult:
    return finish(start(argv, threads), wall_limit_s)


def run_for(url: str, body: Path, concurrency: int, seconds: float) -> HeyResult:
    """POST ``body`` to ``url`` from ``concurrency`` clients for ``seconds``; a minute's grace to end."""
    return run(command(url, body, concurrency=concurrency, duration_s=seconds), seconds + 60)


def shown(argv: list[str]) -> str:
    """The command line as a reader would type it: environment first, the body file by its name."""
    parts = [Path(a).name if a.endswith(".json") else a for a in argv]
    return " ".join([*(f"{k}={v}" for k, v in ENV.items()), *parts])


def version() -> str:
    """hey prints no version; ask the package manager."""
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "hey"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"
