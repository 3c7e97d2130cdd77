"""What every part of the image test shares: the output, commands with time limits, the failure."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "image-test:"


class Failure(Exception):
    """A check that did not pass, or a step that could not run: the message says which and why."""


def say(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


@contextmanager
def step(name: str) -> Iterator[None]:
    """Announce a step, time it, and name it in the failure it raises."""
    say(f"{name} ...")
    started = time.monotonic()
    try:
        yield
    except Failure as failure:
        raise Failure(f"{name}: {failure}") from None
    say(f"{name}: ok ({time.monotonic() - started:.1f} s)")


def run(
    command: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to completion within ``timeout`` seconds, its output captured. ``check``: a
    non-zero exit is a Failure that quotes the command and the end of its output."""
    shown = shlex.join(command)
    try:
        result = subprocess.run(
            list(command),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Failure(f"`{shown}` did not finish within {timeout:.0f} s") from None
    except FileNotFoundError:
        raise Failure(f"`{command[0]}` is not installed") from None
    if check and result.returncode != 0:
        tail = "\n".join((result.stdout or "").splitlines()[-40:])
        raise Failure(f"`{shown}` exited {result.returncode}\n{tail}")
    return result


def wait_for(what: str, probe, *, timeout: float, interval: float = 1.0):
    """Call ``probe`` until it returns something true, and return that; a Failure naming ``what``
    (and the last reason ``probe`` gave, if it raised) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        try:
            value = probe()
            if value:
                return value
        except Exception as error:
            last = f"{type(error).__name__}: {error}"
        if time.monotonic() > deadline:
            raise Failure(f"{what}: not within {timeout:.0f} s (last: {last})")
        time.sleep(interval)


def fail_after(seconds: float) -> None:
    """Turn SIGALRM (after ``seconds``) and SIGTERM into a Failure, so every way out cleans up."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        name = "the overall time limit" if signum == signal.SIGALRM else signal.Signals(signum).name
        raise Failure(f"stopped by {name}")

    signal.signal(signal.SIGALRM, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.alarm(int(seconds))
