"""A server process that a benchmark or a test starts, waits for, and always stops.

``running`` is the one way the benches (bench/), the reliability benches (bench/reliability/) and the
tests that run real servers (tests/support.py) start one: environment, free port, spawn, wait until
ready, stop. Standard library only.

Each process runs in its own session, so that stopping it signals its whole process group (uvicorn
workers included), and with PR_SET_PDEATHSIG, so that it gets SIGTERM should the thread that started
it die: a killed driver leaves no server behind. Its output goes to a log file, quoted in errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SERVICE = (sys.executable, "-m", "service")
# Every other VITSERVE_* variable of the caller is dropped, so that a server runs exactly the settings
# it is given; these pass through, so that `VITSERVE_PROVIDER=cuda python -m bench` measures a GPU.
PASS_THROUGH = (
    "VITSERVE_PROVIDER",
    "VITSERVE_CUDA_DEVICE_ID",
    "VITSERVE_CUDNN_CONV_ALGO_SEARCH",
    "VITSERVE_CUDA_MEM_LIMIT_BYTES",
)


class ServerStartError(RuntimeError):
    """The process exited, or did not become ready in time; the message quotes its log."""


def port_is_free(port: int, *, time_wait_allowed: bool = True) -> bool:
    """Whether ``port`` can be bound by a server (which sets SO_REUSEADDR, so a port that only
    closed connections in TIME_WAIT still hold is free to it); with ``time_wait_allowed`` false,
    whether a plain bind, without SO_REUSEADDR, succeeds too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if time_wait_allowed:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(ports: range, start: int = 0) -> int:
    """A free port of ``ports``, looking from index ``start`` on (and wrapping round): one that no
    connection holds if there is one, so that a caller may bind it without SO_REUSEADDR (a test's
    blocker does); else one that only connections in TIME_WAIT hold."""
    order = [ports[(start + offset) % len(ports)] for offset in range(len(ports))]
    for time_wait_allowed in (False, True):
        for port in order:
            if port_is_free(port, time_wait_allowed=time_wait_allowed):
                return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def clean_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without VITSERVE_* and PORT (the service reads both), plus
    ``overrides``: a server runs exactly the settings it is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_") and k != "PORT"}
    env.update(overrides)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def service_env(port: int, **settings: object) -> dict[str, str]:
    """The environment of ``python -m service`` on ``port``: ``settings`` as VITSERVE_* variables."""
    env = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
    # no gRPC listener unless asked: two servers on one machine would both want its default 8001
    env.update({"VITSERVE_HOST": HOST, "VITSERVE_PORT": str(port), "VITSERVE_GRPC_PORT": "0"})
    env.update({f"VITSERVE_{k.upper()}": str(v) for k, v in settings.items() if v is not None})
    return clean_env(env)


PR_SET_PDEATHSIG = 1
# Looked up here, once: the child runs between fork and exec, where loading a library could
# deadlock on a lock another thread of this process held at the fork.
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    *,
    append: bool = False,
    cwd: Path = REPO,
) -> subprocess.Popen:
    """Start ``argv`` from ``cwd`` (the repository root) with stdout and stderr going to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as handle:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def log_tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    process: subprocess.Popen,
    url: str,
    log: Path,
    *,
    timeout_s: float = 120.0,
    poll_s: float = 0.01,
    name: str = "the server",
    ready_path: str = "/health/ready",
) -> float:
    """Poll ``url`` + ``ready_path`` until it answers 200; the seconds that took. Raises
    ServerStartError, with the end of the log, if the process exits first or time runs out."""
    started = time.perf_counter()
    while True:
        if process.poll() is not None:
            raise ServerStartError(
                f"{name} exited with {process.returncode} before ready:\n{log_tail(log)}"
            )
        try:
            with urllib.request.urlopen(url + ready_path, timeout=1) as answer:
                if answer.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, OSError):
            pass
        if time.perf_counter() - started > timeout_s:
            raise ServerStartError(f"{name} was not ready within {timeout_s:g} s:\n{log_tail(log)}")
        time.sleep(poll_s)


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the process group, then SIGKILL after ``timeout_s``; returns once it has exited,
    so ``process.returncode`` is its exit status. A process that has exited already is left alone."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def http_get(url: str, timeout_s: float = 5.0) -> str | None:
    """The body of a GET, or None when the server did not answer 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.read().decode()
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class RunningServer:
    process: subprocess.Popen
    url: str
    port: int
    log: Path
    ready_s: float  # from spawn to the first 200 of /health/ready


@contextlib.contextmanager
def running(
    argv: Sequence[str],
    env: Callable[[int], Mapping[str, str]],
    log: Path,
    *,
    ports: range,
    start: int = 0,
    ready_timeout_s: float = 120.0,
    poll_s: float = 0.01,
    stop_timeout_s: float = 30.0,
    name: str = "the server",
    ready_path: str = "/health/ready",
    cwd: Path = REPO,
) -> Iterator[RunningServer]:
    """A server on the first free port of ``ports`` (looking from index ``start``), ready; always
    stopped (SIGTERM to its group, SIGKILL after ``stop_timeout_s``) when the block ends.
    ``{port}`` in ``argv`` is replaced; ``env(port)`` is its whole environment; it starts in
    ``cwd``."""
    port = free_port(ports, start)
    process = spawn([part.format(port=port) for part in argv], env(port), log, cwd=cwd)
    url = f"http://{HOST}:{port}"
    try:
        ready_s = wait_ready(
            process,
            url,
            log,
            timeout_s=ready_timeout_s,
            poll_s=poll_s,
            name=name,
            ready_path=ready_path,
        )
        yield RunningServer(process, url, port, log, ready_s)
    finally:
        stop_process(process, timeout_s=stop_timeout_s)


def running_service(
    log: Path, *, ports: range, **settings: object
) -> contextlib.AbstractContextManager[RunningServer]:
    """``python -m service`` with ``settings`` as its VITSERVE_* variables, under :func:`running`."""
    return running(SERVICE, lambda port: service_env(port, **settings), log, ports=ports)
