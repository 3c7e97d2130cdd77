"""A front end's shared-memory arena: the rows of its requests, written once, read by the engine in place.

Each front end owns one POSIX shared-memory block (a file in /dev/shm, mapped with ``mmap``: what
``multiprocessing.shared_memory`` does on Linux, without Python 3.11's resource tracker, which tracks a name
once for every process that maps it and unlinks it when any of them exits). A request's rows take a region
of it (first fit over a free list, in pages), the engine reads them in place by name, offset and shape,
and the region is freed when the engine's answer arrives. A request whose rows do not fit travels inline
in its message instead. The front end unlinks its block when it stops; the supervisor unlinks the blocks
of a front end that died (their names carry the supervisor's pid).

The engine maps only the blocks it expects: a name (never a path) of this service's front ends, whose
last part is the pid of the process on the other end of the link (``expected_block``), a regular file
of this user's in /dev/shm, and reads only rows that lie inside it.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import os
import re
import stat
from dataclasses import dataclass

import numpy as np

PAGE = 4096
PREFIX = "vitserve"
SHM = "/dev/shm"


def block_name(supervisor_pid: int, slot: int, pid: int) -> str:
    return f"{PREFIX}-{supervisor_pid}-{slot}-{pid}"


def expected_block(name: str, supervisor_pid: int, pid: int) -> bool:
    """``name`` is the block a front end of this supervisor's, in process ``pid``, would own."""
    return re.fullmatch(rf"{PREFIX}-{supervisor_pid}-[0-9]{{1,6}}-{pid}", name) is not None


def _map(name: str, size: int = 0, create: bool = False) -> mmap.mmap:
    """Map a block; a new one is reserved in full (posix_fallocate), so that a /dev/shm too small
    (containers get 64 MiB by default) fails here with ENOSPC, not later with SIGBUS on a write. An
    existing one must be a regular file of this user's, never reached through a link."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not the name of a shared-memory block")
    path = os.path.join(SHM, name)
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
        else:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ValueError(f"{name!r} is not a shared-memory block of this service's")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Region:
    offset: int
    size: int


class Arena:
    """The front end's side: allocate, write, free."""

    def __init__(self, name: str, size: int) -> None:
        self.size = size - size % PAGE
        self.block = _map(name, self.size, create=True)
        self.name = name
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset

    def put(self, rows: np.ndarray) -> Region | None:
        """Copy ``rows`` into a free region; None when no region is large enough."""
        need = -(-rows.nbytes // PAGE) * PAGE or PAGE
        for index, (offset, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[index]
                else:
                    self._free[index] = (offset + need, size - need)
                target = np.ndarray(rows.shape, rows.dtype, buffer=self.block, offset=offset)
                target[...] = rows
                return Region(offset, need)
        return None

    def free(self, region: Region) -> None:
        index = bisect.bisect(self._free, (region.offset, region.size))
        start, size = region.offset, region.size
        if index < len(self._free) and start + size == self._free[index][0]:  # joins the next
            size += self._free.pop(index)[1]
        if index and self._free[index - 1][0] + self._free[index - 1][1] == start:  # the previous
            start, previous = self._free[index - 1]
            self._free[index - 1] = (start, previous + size)
        else:
            self._free.insert(index, (start, size))

    def reset(self) -> None:
        """Every region free (the engine that read them is gone)."""
        self._free = [(0, self.size)]

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # rows still referenced: unmapped when they go
            self.block.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, self.name))


class ArenaReader:
    """The engine's side: the rows of a region, read in place from the front end's block."""

    def __init__(self) -> None:
        self._blocks: dict[str, mmap.mmap] = {}
        # each block's bytes as an array: a call's rows are a view of it, made without exporting the
        # mapping's buffer again (the array holds that export, and every view holds the array)
        self._bytes: dict[str, np.ndarray] = {}

    def open(self, name: str) -> None:
        """Map the block ``name`` (checked by the caller to be one it expects); OSError or
        ValueError when it is not a block that can be mapped."""
        if name not in self._blocks:
            block = _map(name)
            self._blocks[name] = block
            self._bytes[name] = np.frombuffer(block, np.uint8)

    def rows(
        self, name: str, offset: int, shape: tuple[int, ...], dtype: np.dtype | str
    ) -> np.ndarray:
        """The rows at ``offset`` of the block ``name`` (opened); ValueError when they do not lie
        inside its pages."""
        block = self._bytes[name]
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize  # numpy's prod costs 40 times as much on a tuple
        if offset % PAGE or offset + nbytes > len(block):
            raise ValueError(
                f"rows of {nbytes} bytes at {offset} do not lie in the {len(block)}-byte arena's "
                "pages"
            )
        # a view of the block's array holds the array, and the array the mapping's buffer, while the
        # rows live, so forget() cannot unmap rows still queued (np.ndarray(buffer=) of the mapping
        # itself held nothing: reading them after crashed the engine)
        return np.ndarray(shape, dtype, block, offset)

    def forget(self, name: str) -> None:
        self._bytes.pop(name, None)
        block = self._blocks.pop(name, None)
        if block is not None:
            # rows of it may still be queued: then the mapping goes when they do
            with contextlib.suppress(BufferError):
                block.close()

    def close(self) -> None:
        for name in list(self._blocks):
            self.forget(name)


def unlink_blocks(supervisor_pid: int, slot: int | None = None) -> list[str]:
    """Unlink the blocks of this supervisor's front ends (of one slot, or all); their names."""
    prefix = f"{PREFIX}-{supervisor_pid}-" + ("" if slot is None else f"{slot}-")
    removed = []
    try:
        names = os.listdir(SHM)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM, name))
                removed.append(name)
            except OSError:
                pass
    return removed
