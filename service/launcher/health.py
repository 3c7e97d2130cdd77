"""``health_port`` under ``python -m service``: probes answered by the supervisor, which does no request work.

A front end's event loop can be busy for hundreds of milliseconds under a flood, and a thread beside it
waits for the same interpreter lock (docs/decisions.md#health-off-the-event-loop). The
supervisor's process is idle, so its listener thread answers at once. What it answers still follows
the processes that serve, through a page of shared memory (:class:`HealthBoard`) where

- each front end's event loop writes the time at every tick (uvicorn's ``callback_notify``, about
  every second), with the pid of the engine it is ready with (0 while it is not ready), and a mark
  when it starts draining;
- the engine's event loop writes the time, its pid and whether it is ready, every ``ENGINE_BEAT_S``,
  and a mark once it has started (loaded its models), which stays: front ends wait for the first
  engine's before they serve, and an engine that dies before any engine was ever ready stops the
  service, while one that dies after (even while it reloads after another's death) is restarted;
- the supervisor clears a process's place when it starts it or sees it die.

Liveness (:attr:`SupervisedHealth.live`): no process whose loop has ticked has then stopped ticking
for ``STALL_S`` (a process still starting, or draining, is not stalled). Readiness
(:attr:`SupervisedHealth.ready`): not shutting down, the engine ready and heard from within
``ENGINE_SILENT_S``, and every front end that is serving (ticking) ready with that engine, at least
one of them: so the health port never says ready while a front end would still answer 503 (after
an engine restart, until its first table comes). Only the standard library: the board is a
``RawArray`` of doubles (no lock: each place has one writer, and an aligned double is stored whole),
its times ``time.monotonic()``, one clock for every process of the machine.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import SpawnContext

from service.frontend.probes import STALL_S

ENGINE_BEAT_S = 0.1  # how often the engine writes its readiness
# an engine not heard from for this long is not ready (as front ends judge it: link/remote.py)
ENGINE_SILENT_S = 3.0
STARTING = 0.0  # a place not written yet: the process is starting (or was just restarted)
DRAINING = -1.0  # a front end that stopped accepting and finishes what it holds
# the places of the page: the engine's four, then two for each front end (its beat, and the pid of
# the engine it is ready with)
_ENGINE_BEAT, _ENGINE_READY, _ENGINE_PID, _ENGINE_STARTED, _FRONT_ENDS = 0, 1, 2, 3, 4


class HealthBoard:
    """The shared page: the engine's last beat, readiness and pid, then each front end's last beat
    and the engine it is ready with."""

    def __init__(self, context: SpawnContext, front_ends: int) -> None:
        self.front_ends = front_ends
        self._values = context.RawArray(ctypes.c_double, _FRONT_ENDS + 2 * front_ends)

    # --- written by the processes -------------------------------------------------------------------

    def engine_started(self) -> None:
        """The engine has loaded its models: front ends serve from now on. (A flag on the page, not a
        ``multiprocessing.Event``: setting one of those waits for every process that waited on it to
        wake, forever when one of them died waiting.)"""
        self._values[_ENGINE_STARTED] = 1.0

    def engine_beat(self, ready: bool, pid: int) -> None:
        self._values[_ENGINE_PID] = pid
        self._values[_ENGINE_READY] = 1.0 if ready else 0.0
        self._values[_ENGINE_BEAT] = time.monotonic()

    def front_end_beat(self, slot: int, ready_with: int) -> None:
        """``ready_with``: the pid of the engine the front end is ready with, 0 when not ready."""
        self._values[_FRONT_ENDS + 2 * slot + 1] = ready_with
        self._values[_FRONT_ENDS + 2 * slot] = time.monotonic()

    def front_end_draining(self, slot: int) -> None:
        self._values[_FRONT_ENDS + 2 * slot + 1] = 0
        self._values[_FRONT_ENDS + 2 * slot] = DRAINING

    # --- written by the supervisor --------------------------------------------------------------------

    def engine_starting(self) -> None:
        self._values[_ENGINE_READY] = 0.0
        self._values[_ENGINE_BEAT] = STARTING
        self._values[_ENGINE_PID] = 0

    def front_end_starting(self, slot: int) -> None:
        self._values[_FRONT_ENDS + 2 * slot + 1] = 0
        self._values[_FRONT_ENDS + 2 * slot] = STARTING

    # --- read by the supervisor, the front ends and the probe listener ---------------------------------

    @property
    def engine_ever_started(self) -> bool:
        """An engine has loaded its models since the supervisor started (not only the current one:
        an engine killed while it reloads after another's death is restarted, not the service's
        end)."""
        return self._values[_ENGINE_STARTED] == 1.0

    def wait_for_engine(self, poll_s: float = 0.02) -> None:
        """Return once an engine has started (a front end's first step; the supervisor stops it if
        none ever starts). A front end started later serves at once, answering 503 until the
        engine of the moment is ready."""
        while not self.engine_ever_started:
            time.sleep(poll_s)

    def engine(self) -> tuple[float, bool, int]:
        """The engine's last beat (``STARTING`` when none yet), whether it was ready then, its pid."""
        values = self._values
        return values[_ENGINE_BEAT], values[_ENGINE_READY] == 1.0, int(values[_ENGINE_PID])

    def front_end(self, slot: int) -> tuple[float, int]:
        """A front end's last beat (or ``STARTING`` or ``DRAINING``) and the engine it was ready
        with then (0: not ready)."""
        beat = self._values[_FRONT_ENDS + 2 * slot]
        return beat, int(self._values[_FRONT_ENDS + 2 * slot + 1])


@dataclass
class FrontEndBeat:
    """A front end's side of the board: uvicorn's ``callback_notify`` (``ready_with``: the pid of
    the engine it is ready with, 0 when not ready), and the drain's mark."""

    board: HealthBoard
    slot: int
    ready_with: Callable[[], int]

    async def __call__(self) -> None:
        self.board.front_end_beat(self.slot, self.ready_with())

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
        engine_beat, _, _ = self.board.engine()
        if engine_beat > STARTING and now - engine_beat >= STALL_S:
            found.append("engine")
        for slot in range(self.board.front_ends):
            beat, _ = self.board.front_end(slot)
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
        engine_beat, engine_ready, engine = self.board.engine()
        if not (engine_ready and engine_beat > STARTING and now - engine_beat < ENGINE_SILENT_S):
            return False
        self._was_ready = True
        serving = [
            ready_with
            for beat, ready_with in map(self.board.front_end, range(self.board.front_ends))
            if beat > STARTING and now - beat < STALL_S
        ]
        return bool(serving) and all(ready_with == engine for ready_with in serving)

    @property
    def phase(self) -> str:
        if self.stopping:
            return "shutting_down"
        return "ready" if self._was_ready or self.ready else "starting"
