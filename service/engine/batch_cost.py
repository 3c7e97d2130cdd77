"""Whether batching pays for a version on this machine, measured when the version loads.

On a GPU a batch of 16 costs little more than one image. On a CPU a heavy ViT costs about the same per
image at any batch size (ViT-Ti/16 at 224 x 224: 30-37 ms an image at batch 1 and at 16, two instances
side by side; BENCHMARKS.md, "At the real size"), and there a batch only adds waiting: the last image of
a batch waits for all of it, and an image that arrives while both instances run batches waits for a
whole one. So on the CPU the engine times every classifier instance alone and in a batch of
``PROBE_BATCH``, all of them at once as they serve, and lets the batcher form batches (up to the config's
max_batch_size) only where they save at least ``SAVING_THAT_PAYS`` of an image's cost; otherwise each
instance runs one image at a time.

Only a heavy model is timed (an image of ``HEAVY_FROM_MS`` or more): for a light one the engine's own
work per batch (the hand-off to a thread, the answers) is a large part of an image's cost, which a
batch shares and this timing of the session alone does not see (the 28 x 28 toy costs 0.9 ms an image,
and 0.86 ms in a batch of 16, timed so). A config that lists ``preferred_batch_size``, and a
``VITSERVE_MAX_BATCH_SIZE``, have chosen their batches and are taken as they stand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

SAVING_THAT_PAYS = 0.1  # of an image's cost at batch 1: a smaller saving is within this CPU's noise
HEAVY_FROM_MS = 5.0  # a lone image's cost from which the engine's per-batch work is under 4% of it
PROBE_BATCH = (
    4  # a batch's saving shows by 4 (weights read once for 4 images), and it is quick to time
)
ROUNDS = 2  # in alternating order, so that neither size always runs first
LONE_RUNS = 2


@dataclass(frozen=True)
class BatchCost:
    """What one image cost, in ms, alone and in a batch of ``size`` (None: not timed, a light model)."""

    lone_ms: float
    batched_ms: float | None = None
    size: int = PROBE_BATCH

    @property
    def heavy(self) -> bool:
        return self.lone_ms >= HEAVY_FROM_MS

    @property
    def batching_pays(self) -> bool:
        if self.batched_ms is None:
            return True
        return self.batched_ms <= (1 - SAVING_THAT_PAYS) * self.lone_ms

    def batch_limit(self, max_batch_size: int) -> int:
        """The largest batch the batcher should form: the config's where batching pays, else 1."""
        return max_batch_size if self.batching_pays else 1


def measure(
    runners: Sequence[Callable[[np.ndarray], object]],
    images: np.ndarray,
    clock: Callable[[], float] = time.perf_counter,
) -> BatchCost:
    """Time ``runners`` (one per instance, all at once, each in its own thread) on ``images[:1]``, and
    on ``images[:PROBE_BATCH]`` where a lone image is heavy; the least cost per image over every
    instance and round (the least, not the median: other work on the machine only ever adds time, and
    a light model must not pass for heavy because the machine was busy while it loaded)."""
    size = min(PROBE_BATCH, len(images))
    samples: dict[int, list[float]] = {1: [], size: []}

    def run(runner: Callable[[np.ndarray], object], batches: tuple[int, ...]) -> None:
        for batch in batches:
            runs = LONE_RUNS if batch == 1 else 1
            started = clock()
            for _ in range(runs):
                runner(images[:batch])
            samples[batch].append((clock() - started) / (runs * batch))

    with ThreadPoolExecutor(max_workers=len(runners)) as pool:

        def each_instance(batches: tuple[int, ...]) -> None:
            for future in [pool.submit(run, runner, batches) for runner in runners]:
                future.result()

        each_instance((1,))
        lone = BatchCost(lone_ms=min(samples[1]) * 1e3)
        if not lone.heavy or size == 1:
            return lone
        for round_ in range(ROUNDS):
            each_instance((size, 1) if round_ % 2 == 0 else (1, size))
    return BatchCost(
        lone_ms=min(samples[1]) * 1e3,
        batched_ms=min(samples[size]) * 1e3,
        size=size,
    )
