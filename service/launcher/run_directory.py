"""The supervisor's private directory in TMPDIR: the engine's socket and the metrics' files.

Its name carries the supervisor's pid (``vitserve-PID-XXXXXXXX``): a supervisor that was killed
(kill -9, an OOM kill) cannot remove its own, so each supervisor, before it makes its own, removes
those of its user whose supervisor no longer runs, and their shared-memory blocks in /dev/shm, whose
names carry the same pid (service/link/arena.py). A directory whose pid runs is kept, even if that
pid is another program's now: removing a live service's socket would cut its front ends off.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

from service.link.arena import unlink_blocks

logger = logging.getLogger("vitserve")

PREFIX = "vitserve-"
_NAME = re.compile(rf"{PREFIX}(\d+)-\w+")  # mkdtemp's suffix: letters, digits and _


def create() -> str:
    """A new private directory (0700) for this supervisor, once the stale ones are gone."""
    remove_stale()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_stale(parent: str | None = None) -> list[str]:
    """Remove the run directories in ``parent`` (TMPDIR) of this user's supervisors that no longer
    run, and their shared-memory blocks; the directories' paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(parent, name)
        owner = int(match[1])
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if owner != os.getpid() and _running(owner):  # our own pid: a predecessor's, reused
            continue
        shutil.rmtree(path, ignore_errors=True)
        unlink_blocks(owner)
        removed.append(path)
        logger.warning("removed %s, left by a supervisor (pid %d) that no longer runs", path, owner)
    return removed


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed supervisor not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as status:
            return status.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
