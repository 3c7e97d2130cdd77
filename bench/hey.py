"""Run Debian's ``hey`` (github.com/rakyll/hey, 0.1.4) and parse its summary.

hey's summary counts every answered request in ``Requests/sec`` (errors included) and computes its
latency percentiles over every answered request whatever its status (503s included); transport errors
(refused, reset, timed out) are only in the error distribution. So the figures we keep are computed
from the counts: ``ok_rps`` is the 200 answers per second of the run's total time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

PERCENTILES = (10, 25, 50, 75, 90, 95, 99)


class HeyError(RuntimeError):
    pass


@dataclass
class HeyResult:
    total_s: float
    rps: float  # hey's own: every answered request and every error, per second
    slowest_s: float | None
    fastest_s: float | None
    average_s: float | None
    percentiles_s: dict[int, float] = field(default_factory=dict)
    status_codes: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.status_codes.get(200, 0)

    @property
    def answered(self) -> int:
        return sum(self.status_codes.values())

    @property
    def not_ok(self) -> int:
        return self.answered - self.ok

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def ok_rps(self) -> float:
        return self.ok / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            ok=self.ok,
            not_ok=self.not_ok,
            error_count=self.error_count,
            ok_rps=self.ok_rps,
            percentiles_s={str(k): v for k, v in self.percentiles_s.items()},
            status_codes={str(k): v for k, v in self.status_codes.items()},
        )
        return data


_SECS = r"([0-9.]+|NaN)\s+secs"


def _number(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text)
    if not match or match.group(1) == "NaN":
        return None
    return float(match.group(1))


def _section(text: str, title: str) -> list[str]:
    """The indented lines under ``title:`` up to the next blank line."""
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
    """Parse hey's default (non-CSV) output."""
    total = _number(r"Total:\s+" + _SECS, text)
    rps = _number(r"Requests/sec:\s+([0-9.]+|NaN)", text)
    if total is None or rps is None:
        raise HeyError(f"not a hey summary (no Total / Requests/sec):\n{text[:2000]}")
    percentiles = {}
    for line in _section(text, "Latency distribution"):
        match = re.match(r"([0-9]+)(?:\.[0-9]+)?%\s+in\s+([0-9.]+)\s+secs", line)
        if match:
            percentiles[int(match.group(1))] = float(match.group(2))
    status_codes = {}
    for line in _section(text, "Status code distribution"):
        match = re.match(r"\[([0-9]+)\]\s+([0-9]+)\s+responses", line)
        if match:
            status_codes[int(match.group(1))] = int(match.group(2))
    errors = {}
    for line in _section(text, "Error distribution"):
        match = re.match(r"\[([0-9]+)\]\s+(.*)", line)
        if match:
            message = match.group(2).strip()
            errors[message] = errors.get(message, 0) + int(match.group(1))
    return HeyResult(
        total_s=total,
        rps=rps,
        slowest_s=_number(r"Slowest:\s+" + _SECS, text),
        fastest_s=_number(r"Fastest:\s+" + _SECS, text),
        average_s=_number(r"Average:\s+" + _SECS, text),
        percentiles_s=percentiles,
        status_codes=status_codes,
        errors=errors,
    )


def hey_binary() -> str:
    path = shutil.which("hey")
    if path is None:
        raise HeyError("hey is not installed (Debian: apt-get install hey)")
    return path


def command(
    url: str,
    body: Path,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    timeout_s: int = 30,
    binary: str = "hey",
) -> list[str]:
    """A fixed-duration (``-z``) or fixed-count (``-n``) POST of a JSON body."""
    if (duration_s is None) == (requests is None):
        raise ValueError("give exactly one of duration_s or requests")
    amount = ["-z", f"{duration_s:g}s"] if duration_s is not None else ["-n", str(requests)]
    return [
        binary,
        *amount,
        "-c",
        str(concurrency),
        "-t",
        str(timeout_s),
        "-m",
        "POST",
        "-T",
        "application/json",
        "-D",
        str(body),
        url,
    ]


def run(argv: list[str], wall_limit_s: float) -> tuple[HeyResult, str]:
    """Run hey; returns the parsed summary and the raw text."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=wall_limit_s)
    except subprocess.TimeoutExpired as error:
        raise HeyError(f"hey ran past {wall_limit_s:.0f} s: {' '.join(argv)}") from error
    if done.returncode != 0:
        raise HeyError(f"hey exited {done.returncode}: {done.stderr.strip()[:500]}")
    return parse_summary(done.stdout), done.stdout


def version() -> str:
    """hey prints no version; ask the package manager."""
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "hey"], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
