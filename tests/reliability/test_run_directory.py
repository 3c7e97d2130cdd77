"""``run_directory.remove_stale``: which ``vitserve-PID-*`` directories a starting supervisor removes from
TMPDIR (those of its user whose supervisor no longer runs, its own pid's included: that pid's earlier
owner is gone) and which it leaves (a running pid's, another user's, anything not such a directory),
with the dead supervisors' shared-memory blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.launcher.run_directory import remove_stale
from service.link.arena import PREFIX, SHM


def no_such_pid() -> int:
    """A pid no process can have: above the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_the_directories_of_supervisors_gone_are_removed_with_their_blocks_and_no_others(
    tmp_path,
):
    dead = no_such_pid()
    gone = [tmp_path / f"vitserve-{dead}-a1_b2", tmp_path / f"vitserve-{os.getpid()}-x9"]
    kept = [tmp_path / "vitserve-1-c3", tmp_path / "vitserve-d4", tmp_path / "vitserve-e5-f6"]
    for directory in gone + kept:
        directory.mkdir()
    (gone[0] / "metrics").mkdir()
    (gone[0] / "engine").write_bytes(b"")
    (tmp_path / f"vitserve-{dead}-file").write_bytes(b"")  # not a directory: kept
    (tmp_path / f"vitserve-{dead}-link").symlink_to(kept[0])  # a link: kept, and its target
    others = tmp_path / f"vitserve-{dead}-theirs"
    others.mkdir()
    if os.geteuid() == 0:
        os.chown(others, 65534, 65534)  # another user's: kept
        kept.append(others)
    else:
        others.rmdir()
    block = Path(SHM) / f"{PREFIX}-{dead}-0-1"
    block.write_bytes(b"\0" * 4096)
    try:
        removed = remove_stale(str(tmp_path))
        assert sorted(removed) == sorted(map(str, gone))
        assert all(directory.is_dir() for directory in kept)
        assert (tmp_path / f"vitserve-{dead}-file").exists()
        assert (tmp_path / f"vitserve-{dead}-link").is_symlink()
        assert not block.exists()
    finally:
        block.unlink(missing_ok=True)


def test_a_temporary_directory_that_cannot_be_read_removes_nothing(tmp_path):
    assert remove_stale(str(tmp_path / "missing")) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_temporary_directory_is_passed_over(tmp_path):
    tmp_path.chmod(0)
    try:
        assert remove_stale(str(tmp_path)) == []
    finally:
        tmp_path.chmod(0o700)
