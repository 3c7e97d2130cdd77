"""The profiler hook of ``python -m bench.request_walk``, installed in a process as its
``sitecustomize`` (a directory on PYTHONPATH that holds this file under that name).

It counts the calls of every Python function whose file lies under ``REQUEST_WALK_ROOT`` (the served
checkout's ``service/`` directory), in every thread (``sys.setprofile`` for the thread that starts,
``threading.setprofile`` for those started later). A call is a profiler ``call`` event: a function
entered, or a coroutine or generator resumed. On ``SIGNAL`` it reads a tag from
``REQUEST_WALK_DIR/command``, writes what it counted since the last such signal to
``REQUEST_WALK_DIR/{tag}-{pid}.json`` and starts counting afresh. A forked child starts afresh too.
Without both variables it does nothing. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

SIGNAL = signal.SIGUSR2  # the service uses SIGTERM, SIGINT and SIGUSR1
ROOT_VARIABLE = "REQUEST_WALK_ROOT"
DIRECTORY_VARIABLE = "REQUEST_WALK_DIR"
COMMAND_FILE = "command"

_counts: dict = {}


def _profile(frame, event, arg) -> None:
    if event == "call":
        code = frame.f_code
        if code.co_filename.startswith(_root):
            _counts[code] = _counts.get(code, 0) + 1


def _process_name() -> str:
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return "?"


def _take(signum, frame) -> None:
    """Write what was counted since the last take, under the tag the command file holds, and
    start again."""
    global _counts
    taken, _counts = _counts, {}
    directory = Path(os.environ[DIRECTORY_VARIABLE])
    tag = (directory / COMMAND_FILE).read_text().strip()
    functions = [
        {
            "file": code.co_filename,
            "function": code.co_qualname,
            "line": code.co_firstlineno,
            "calls": calls,
        }
        for code, calls in list(taken.items())
    ]
    report = {"pid": os.getpid(), "process": _process_name(), "functions": functions}
    target = directory / f"{tag}-{os.getpid()}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.rename(target)  # whole or absent: the bench polls for it


def _start_afresh() -> None:
    global _counts
    _counts = {}


_root = os.environ.get(ROOT_VARIABLE, "")
if _root and os.environ.get(DIRECTORY_VARIABLE):
    signal.signal(SIGNAL, _take)
    os.register_at_fork(after_in_child=_start_afresh)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
