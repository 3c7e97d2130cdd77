"""A small tmpfs, filled to the brim, for the tests of a full TMPDIR; unmounted after.

Mounting needs root (or CAP_SYS_ADMIN): elsewhere the tests that need one are skipped, saying why."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def full_tmpfs(size_kib: int = 512, room_bytes: int = 0) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` holding one file that leaves ``room_bytes`` free."""
    mount_point = Path(tempfile.mkdtemp(prefix="full-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=1777", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with open(mount_point / "filler", "wb") as filler, contextlib.suppress(OSError):
            filler.write(b"\0" * (size_kib * 1024 - room_bytes))  # ENOSPC at the brim
        free = os.statvfs(mount_point)
        assert free.f_bavail * free.f_frsize <= room_bytes + free.f_frsize
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
        mount_point.rmdir()
