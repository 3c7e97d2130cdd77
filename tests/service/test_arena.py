"""The front end's shared-memory arena: rows written by one side are read in place by the other, regions
are reused once freed (neighbours join again), and a block /dev/shm cannot hold is refused at once
(never a SIGBUS on a later write)."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest

from service.link.arena import PAGE, SHM, Arena, ArenaReader


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
        assert arena.free_bytes == arena.size - sum(r.size for r in held)
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
