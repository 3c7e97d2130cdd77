"""The front end's shared-memory arena: rows written by one side are read in place by the other, regions
are reused once freed (neighbours join again), and a block /dev/shm cannot hold is refused at once
(never a SIGBUS on a later write)."""

from __future__ import annotations

import itertools
import mmap
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from service.link.arena import (
    PAGE,
    SHM,
    Arena,
    ArenaReader,
    block_name,
    expected_block,
    unlink_blocks,
)
from tests.support import REPO


@pytest.fixture
def arena():
    block = Arena(f"vitserve-test-{os.getpid()}-{random.randrange(1 << 30)}", 64 * PAGE)
    yield block
    block.close()
    assert not os.path.exists(os.path.join(SHM, block.name))


def test_rows_are_read_in_place_by_name_offset_and_shape(arena):
    rows = np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    region = arena.put(rows)
    reader = ArenaReader()
    reader.open(arena.name)
    seen = reader.rows(arena.name, region.offset, rows.shape, rows.dtype.str)
    np.testing.assert_array_equal(seen, rows)
    reader.close()


def test_regions_are_reused_and_neighbours_join_again(arena):
    rng = random.Random(1)
    held = []
    for _ in range(400):  # against a model: the free bytes are the block less what is held
        if held and rng.random() < 0.5:
            arena.free(held.pop(rng.randrange(len(held))))
        else:
            region = arena.put(np.zeros(rng.randrange(1, 3 * PAGE), np.uint8))
            if region is not None:
                held.append(region)
        assert sum(size for _, size in arena._free) == arena.size - sum(r.size for r in held)
        spans = sorted((r.offset, r.offset + r.size) for r in held)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    for region in held:
        arena.free(region)
    assert arena.put(np.zeros(arena.size, np.uint8)) is not None  # whole again: one free span


def test_rows_that_do_not_fit_are_not_placed(arena):
    assert arena.put(np.zeros(arena.size + 1, np.uint8)) is None


def test_a_block_dev_shm_cannot_hold_is_refused_at_once_and_leaves_nothing():
    name = f"vitserve-test-{os.getpid()}-huge"
    # ENOSPC (No space left on device), EFBIG (File too large) or ENOMEM, as the tmpfs has it
    with pytest.raises(OSError, match=r"space|large|memory"):
        Arena(name, 1 << 50)
    assert not os.path.exists(os.path.join(SHM, name))


# --- what the mutation run of service/link/arena.py found unpinned (docs/testing.md) --------------


def test_a_block_is_a_private_file_in_dev_shm_of_whole_pages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block made anywhere but /dev/shm would land here
    name = f"vitserve-test-{os.getpid()}-{random.randrange(1 << 30)}"
    block = Arena(name, 3 * PAGE + 100)
    try:
        assert block.size == 3 * PAGE and whole_again(block)
        status = os.stat(os.path.join(SHM, name))
        assert status.st_size == 3 * PAGE and status.st_mode & 0o777 == 0o600
        assert list(tmp_path.iterdir()) == []
    finally:
        block.close()


def test_each_region_is_read_at_its_own_offset(arena):
    first, second = np.full((2, 5), 1.5, np.float32), np.arange(7, dtype=np.int64)
    regions = [arena.put(first), arena.put(second)]
    assert regions[1].offset == PAGE
    reader = ArenaReader()
    reader.open(arena.name)
    np.testing.assert_array_equal(reader.rows(arena.name, PAGE, (7,), "<i8"), second)
    np.testing.assert_array_equal(reader.rows(arena.name, 0, (2, 5), "<f4"), first)
    reader.close()


def test_a_full_arena_freed_is_whole_again_and_reset_frees_everything(arena):
    whole = arena.put(np.zeros(arena.size, np.uint8))
    assert whole is not None and arena.put(np.zeros(1, np.uint8)) is None
    arena.free(whole)
    assert whole_again(arena)
    for _ in range(3):
        arena.put(np.zeros(PAGE, np.uint8))
    arena.reset()
    assert whole_again(arena)
    assert arena.put(np.zeros(10, np.uint8)).offset == 0


def test_closing_twice_is_quiet():
    block = Arena(f"vitserve-test-{os.getpid()}-{random.randrange(1 << 30)}", 4 * PAGE)
    block.put(np.ones(8, np.uint8))
    block.close()
    assert not os.path.exists(os.path.join(SHM, block.name))
    block.close()  # the file is gone already: nothing to unlink, no error


def test_rows_still_referenced_outlive_forget_and_close():
    """Found by the mutation run (docs/testing.md): rows queued in the engine when their front end's
    block is forgotten and closed are still read whole, not from an unmapped page (a crash)."""
    script = """
import os, random
import numpy as np
from service.link.arena import PAGE, Arena, ArenaReader
arena = Arena(f"vitserve-test-{os.getpid()}-{random.randrange(1 << 30)}", 4 * PAGE)
region = arena.put(np.arange(8, dtype=np.uint8))
reader = ArenaReader()
reader.open(arena.name)
rows = reader.rows(arena.name, region.offset, (8,), "|u1")  # queued in the engine, say
reader.forget(arena.name)  # the front end went away
arena.close()
print(int(rows.sum()))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (result.returncode, result.stdout.strip()) == (0, "28"), result.stderr[-500:]


def test_a_reader_maps_a_block_once_and_forgets_it_when_told(arena):
    rows = np.arange(4, dtype=np.uint8)
    region = arena.put(rows)
    reader = ArenaReader()
    reader.open(arena.name)
    seen = reader.rows(arena.name, region.offset, (4,), "|u1")
    mapping = seen.base
    os.unlink(os.path.join(SHM, arena.name))  # gone from /dev/shm: only the mapping is left
    reader.open(arena.name)  # mapped already: not opened again
    np.testing.assert_array_equal(reader.rows(arena.name, region.offset, (4,), "|u1"), rows)
    reader.forget(arena.name)  # rows still referenced: the mapping goes when they do
    del seen
    with pytest.raises(KeyError):
        reader.rows(arena.name, region.offset, (4,), "|u1")
    with pytest.raises(FileNotFoundError):
        reader.open(arena.name)
    reader.forget("never-mapped")
    assert mapping is not None


def mapping_of(rows: np.ndarray) -> mmap.mmap:
    base = rows
    while not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_forgetting_a_block_closes_its_mapping(arena):
    reader = ArenaReader()
    reader.open(arena.name)
    seen = reader.rows(arena.name, 0, (4,), "|u1")
    mapping = mapping_of(seen)
    del seen
    reader.forget(arena.name)
    assert mapping.closed
    other = ArenaReader()
    other.open(arena.name)
    seen = other.rows(arena.name, 0, (4,), "|u1")
    mapping = mapping_of(seen)
    del seen
    other.close()
    assert mapping.closed


def test_unlink_blocks_removes_one_slot_or_every_slot_of_one_supervisor():
    supervisor, stranger = os.getpid(), os.getpid() + 1_000_000_000
    names = {
        (slot, pid): block_name(owner, slot, pid)
        for owner, slot, pid in [
            (supervisor, 1, 11),
            (supervisor, 1, 12),
            (supervisor, 10, 13),
            (supervisor, 2, 14),
            (stranger, 1, 15),
        ]
    }
    blocks = [Arena(name, PAGE) for name in names.values()]
    try:
        assert sorted(unlink_blocks(supervisor, 1)) == [names[1, 11], names[1, 12]]
        assert sorted(unlink_blocks(supervisor)) == sorted([names[10, 13], names[2, 14]])
        assert unlink_blocks(supervisor) == []
        assert os.path.exists(os.path.join(SHM, names[1, 15]))
    finally:
        for block in blocks:
            block.close()


def test_the_reader_maps_only_shared_memory_blocks_and_reads_only_inside_them(arena, tmp_path):
    """A name is never a path: a name that leads out of /dev/shm, a link in it (to a system file the
    engine could read), or a file not of this user's is not mapped; rows said to lie past the
    block's end, or off a page boundary, are not read."""
    reader = ArenaReader()
    for name in ("../../etc/ld.so.cache", "/etc/ld.so.cache", "", ".", ".."):
        with pytest.raises((OSError, ValueError)):
            reader.open(name)
    link = f"vitserve-test-{os.getpid()}-{random.randrange(1 << 30)}-link"
    os.symlink("/etc/hostname", os.path.join(SHM, link))
    try:
        with pytest.raises(OSError, match="symbolic links"):
            reader.open(link)
    finally:
        os.unlink(os.path.join(SHM, link))
    reader.open(arena.name)
    with pytest.raises(ValueError, match="do not lie"):
        reader.rows(arena.name, arena.size - PAGE, (2, PAGE // 4), "<f4")  # past its end
    with pytest.raises(ValueError, match="do not lie"):
        reader.rows(arena.name, 4, (1,), "<f4")  # not where a region starts
    assert reader.rows(arena.name, arena.size - PAGE, (PAGE // 4,), "<f4").size == PAGE // 4
    reader.close()


def test_a_block_s_expected_name_carries_the_supervisor_and_the_front_end_s_pid():
    assert expected_block(block_name(10, 3, 77), 10, 77)
    for name in (block_name(11, 3, 77), block_name(10, 3, 78), "vitserve-10-3-77/../x", "x"):
        assert not expected_block(name, 10, 77)


def whole_again(arena: Arena) -> bool:
    """Every byte of ``arena`` is free: rows as large as the block fit (and are freed again)."""
    region = arena.put(np.zeros(arena.size, np.uint8))
    if region is None:
        return False
    arena.free(region)
    return True
