"""``health_port`` under ``python -m service``: probes answered by the supervisor, which does no request work.

A front end's event loop can be busy for hundreds of milliseconds under a flood, and a thread beside it
waits for the same interpreter lock (issue 25: a p99 of 78-148 ms at the connection cap). The
supervisor's process is idle, so its listener thread answers at once. What it answers still follows
the processes that serve, through a page of shared memory (:class:`HealthBoard`) where

- each front end's event loop writes the time at every tick (uvicorn's ``callback_notify``, every
  second or two), and a mark when it starts draining;
- the engine's event loop writes the time and whether it is ready, every ``ENGINE_BEAT_S``;
- the supervisor clears a process's place when it starts it or sees it die.

Liveness (:attr:`SupervisedHealth.live`): no process whose loop has ticked has then stopped ticking
for ``STALL_S`` (a process still starting, or draining, is not stalled). Readiness
(:attr:`SupervisedHealth.ready`): not shutting down, the engine ready and heard from within
``ENGINE_SILENT_S``, and at least one front end ticking. Only the standard library: the board is a
``RawArray`` of doubles (no lock: each place has one writer, and an aligned double is stored whole),
its times ``time.monotonic()``, one clock for every process of the machine.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from multiprocessing.context import SpawnContext

from service.frontend.probes import STALL_S

ENGINE_BEAT_S = 0.1  # how often the engine writes its readiness
# an engine not heard from for this long is not ready (as front ends judge it: link/remote.py)
ENGINE_SILENT_S = 3.0
STARTING = 0.0  # a place not written yet: the process is starting (or was just restarted)
DRAINING = -1.0  # a front end that stopped accepting and finishes what it holds
_ENGINE_BEAT, _ENGINE_READY, _FRONT_ENDS = 0, 1, 2


class HealthBoard:
    """The shared page: the engine's last beat and readiness, then each front end's last beat."""

    def __init__(self, context: SpawnContext, front_ends: int) -> None:
        self.front_ends = front_ends
        self._values = context.RawArray(ctypes.c_double, _FRONT_ENDS + front_ends)

    # --- written by the processes -------------------------------------------------------------------

    def engine_beat(self, ready: bool) -> None:
        self._values[_ENGINE_READY] = 1.0 if ready else 0.0
        self._values[_ENGINE_BEAT] = time.monotonic()

    def front_end_beat(self, slot: int) -> None:
        self._values[_FRONT_ENDS + slot] = time.monotonic()

    def front_end_draining(self, slot: int) -> None:
        self._values[_FRONT_ENDS + slot] = DRAINING

    # --- written by the supervisor --------------------------------------------------------------------

    def engine_starting(self) -> None:
        self._values[_ENGINE_READY] = 0.0
        self._values[_ENGINE_BEAT] = STARTING

    def front_end_starting(self, slot: int) -> None:
        self._values[_FRONT_ENDS + slot] = STARTING

    # --- read by the supervisor's probe listener ------------------------------------------------------

    def engine(self) -> tuple[float, bool]:
        """The engine's last beat (``STARTING`` when none yet) and whether it was ready then."""
        return self._values[_ENGINE_BEAT], self._values[_ENGINE_READY] == 1.0

    def front_end(self, slot: int) -> float:
        """A front end's last beat, or ``STARTING`` or ``DRAINING``."""
        return self._values[_FRONT_ENDS + slot]


@dataclass
class FrontEndBeat:
    """A front end's side of the board: uvicorn's ``callback_notify``, and the drain's mark."""

    board: HealthBoard
    slot: int

    async def __call__(self) -> None:
        self.board.front_end_beat(self.slot)

    def draining(self) -> None:
        self.board.front_end_draining(self.slot)


class SupervisedHealth:
    """What the supervisor's probe listener answers (``probes.probe_answer``): ``ready``, ``phase``
    and ``live``, read from the board and the supervisor's own state."""

    def __init__(self, board: HealthBoard) -> None:
        self.board = board
        self.stopping = False  # set by the supervisor's signal handler: not ready from then on
        self._was_ready = False  # the engine has been ready once: "unavailable", not "starting"

    def stalled(self, now: float | None = None) -> list[str]:
        """The processes whose event loop has ticked, then not for ``STALL_S``."""
        now = time.monotonic() if now is None else now
        found = []
        engine_beat, _ = self.board.engine()
        if engine_beat > STARTING and now - engine_beat >= STALL_S:
            found.append("engine")
        for slot in range(self.board.front_ends):
            beat = self.board.front_end(slot)
            if beat > STARTING and now - beat >= STALL_S:
                found.append(f"front end {slot}")
        return found

    @property
    def live(self) -> bool:
        return not self.stalled()

    @property
    def ready(self) -> bool:
        if self.stopping:
            return False
        now = time.monotonic()
        engine_beat, engine_ready = self.board.engine()
        if not (engine_ready and engine_beat > STARTING and now - engine_beat < ENGINE_SILENT_S):
            return False
        self._was_ready = True
        return any(
            self.board.front_end(slot) > STARTING and now - self.board.front_end(slot) < STALL_S
            for slot in range(self.board.front_ends)
        )

    @property
    def phase(self) -> str:
        if self.stopping:
            return "shutting_down"
        return "ready" if self._was_ready or self.ready else "starting"
