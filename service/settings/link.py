"""``python -m service``'s processes: how many front ends feed the engine, and what each one shares with it."""

from __future__ import annotations

from pydantic import Field

from service.machine import usable_cores
from service.settings.group import SettingsGroup


class LinkSettings(SettingsGroup):
    """The front-end processes and the shared memory each one hands the engine its rows in."""

    workers: int | None = Field(
        default=None,
        ge=0,
        le=256,
        description=(
            "`python -m service`: front-end processes (HTTP and gRPC, decoding), all feeding one "
            "engine process that batches and runs the models; unset: one per usable core but one "
            "(the engine's), at least one; 0: a single process that runs the engine itself."
        ),
    )
    arena_mib: int = Field(
        default=16,
        ge=1,
        le=4096,
        description=(
            "`python -m service` with front-end processes: shared memory (MiB) each one has for the "
            "rows it hands the engine; rows that do not fit travel inside the message instead."
        ),
    )

    @property
    def front_end_count(self) -> int:
        """Front-end processes: ``workers``, or one per usable core but the engine's. On two cores,
        one front end beside the engine spent 2.48 ms of CPU a request at c=64 where two spent
        2.71, for as many answers (BENCHMARKS.md, "What a request costs")."""
        if self.workers is not None:
            return self.workers
        return max(1, usable_cores() - 1)
