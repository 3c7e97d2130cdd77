"""Run Debian's ``wrk`` (4.1) with a POST body and parse its summary.

wrk keeps its ``-c`` connections open for the whole run, each sending its next request as soon as
the last is answered: the way a pool of keep-alive clients loads a server, where ``hey`` opens a
connection per worker and pays for it differently (the seam issue: the tail at c=256 depended on
which of the two drove the server). One thread (``-t1``, as bench/hey.py's ``GOMAXPROCS=1``), so the
load generator takes at most one core; ``--timeout`` longer than any answer, so no slow request is
left out of the percentiles (wrk drops a timed-out request from its latencies).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 30
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "{content_type}"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
"""


class WrkError(RuntimeError):
    pass


@dataclass(frozen=True)
class WrkResult:
    requests: int  # answered, whatever their status
    seconds: float
    percentiles_s: dict[int, float]  # 50, 75, 90, 99
    not_ok: int  # answers other than 2xx/3xx
    socket_errors: int  # connect, read, write and timeout errors together

    @property
    def ok_rps(self) -> float:
        return (self.requests - self.not_ok) / self.seconds if self.seconds else 0.0


def _duration_s(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise WrkError(f"wrk printed a duration this parser does not know: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse(output: str) -> WrkResult:
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m),", output)
    if done is None:
        raise WrkError(f"no summary in wrk's output:\n{output}")
    percentiles = {
        int(p): _duration_s(value)
        for p, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", output, re.MULTILINE)
    }
    not_ok = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return WrkResult(
        requests=int(done.group(1)),
        seconds=_duration_s(done.group(2) + done.group(3)),
        percentiles_s=percentiles,
        not_ok=int(not_ok.group(1)) if not_ok else 0,
        socket_errors=sum(map(int, errors.groups())) if errors else 0,
    )


def available() -> bool:
    return shutil.which("wrk") is not None


def run(
    url: str, body: bytes, concurrency: int, seconds: float, content_type: str = "application/json"
) -> WrkResult:
    """``concurrency`` connections POSTing ``body`` to ``url`` for ``seconds``."""
    if not available():
        raise WrkError("wrk is not installed (Debian: apt-get install wrk; `make wrk` installs it)")
    with tempfile.TemporaryDirectory(prefix="vitserve-wrk-") as folder:
        body_file, script = Path(folder, "body"), Path(folder, "post.lua")
        body_file.write_bytes(body)
        script.write_text(_SCRIPT.format(content_type=content_type, body=body_file))
        argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", f"--timeout={TIMEOUT_S}s"]
        done = subprocess.run(
            [*argv, "--latency", "-s", str(script), url],
            capture_output=True,
            text=True,
            timeout=seconds + TIMEOUT_S + 30,
            check=False,
        )
    if done.returncode != 0:
        raise WrkError(f"wrk exited {done.returncode}: {done.stderr.strip() or done.stdout}")
    return parse(done.stdout)
