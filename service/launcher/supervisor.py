"""``python -m service``: one engine process and ``workers`` front-end processes, supervised.

The supervisor holds every port it serves for the service's whole life (service/launcher/ports.py): the
HTTP port, one listening socket per front end in a SO_REUSEPORT group, the gRPC port (every front end
binds it beside the supervisor's socket with SO_REUSEPORT) and the health port. It spawns the engine,
then imports the web stack once while the engine loads, and forks the front ends from itself, as
gunicorn's ``preload_app`` does. It restarts a process that dies: a front end alone (only the requests
it held are lost), or the engine, with its models loaded again, while the front ends answer 503 with
Retry-After; a front end whose event loop has stopped ticking for ``KILL_STALLED_S`` (stopped, or
stuck) is killed and replaced. The service stops (exit code 3) only when an engine fails before any
engine was ever ready (a model that does not load); an engine killed while it reloads is restarted
again. On SIGTERM or SIGINT: the front ends stop accepting and finish what they hold, the engine runs
what was admitted, then everything exits (code 0). Metrics from every process are summed by
prometheus-client's multiprocess mode, in the supervisor's private directory. With
``health_port`` set, the supervisor answers the probes there itself, from a thread, reading what its
children write on a shared page (service/launcher/health.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from service.frontend.probes import STALL_S, ProbeListener
from service.launcher import processes, run_directory
from service.launcher.health import STARTING, HealthBoard, SupervisedHealth
from service.launcher.ports import hold_grpc, is_loose, listen, tighten
from service.launcher.process_setup import ANSWER_MARGIN_S
from service.link.arena import unlink_blocks
from service.link.wire import Addresses
from service.settings import Settings

logger = logging.getLogger("vitserve")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the service drains and stops
# after 0, 1, 2, ... deaths within STABLE_S; an engine that was ready forgets the deaths before it
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
STABLE_S = 30.0
KILL_WAIT_S = 5.0
# a front end whose loop has not ticked for this long is killed and replaced: 5 s after the health
# port began to report it not live (STALL_S), so that probes see the stall before it is mended
KILL_STALLED_S = STALL_S + 5.0


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.count = settings.link.front_end_count
        # the connection cap is the service's: each front end holds its share
        share = max(1, -(-settings.server.max_connections // self.count))
        self.settings = settings.model_copy(update={"max_connections": share})
        self.spawn = multiprocessing.get_context("spawn")
        self.fork = multiprocessing.get_context("fork")
        self.pid = os.getpid()
        self.stopping = False
        self.engine: BaseProcess | None = None
        self.front_ends: dict[int, BaseProcess] = {}
        self.deaths: dict[str, list[float]] = {}
        self.board = HealthBoard(self.spawn, self.count)
        self.health = SupervisedHealth(self.board)
        self.probes: ProbeListener | None = None
        self.grpc_hold: list[socket.socket] = []  # the gRPC port, held (ports.py)

    # --- processes --------------------------------------------------------------------------------

    def _start_engine(self) -> None:
        self.board.engine_starting()
        self.engine = self.spawn.Process(
            target=processes.engine,
            args=(self.settings, self.addresses, self.pid, self.board),
            name="vitserve-engine",
        )
        self.engine.start()

    def _start_front_end(self, slot: int) -> None:
        """Forked while the supervisor runs no other thread (a lock another thread held would stay
        held in the child): the front end then starts with the web stack the supervisor imported
        (processes.preload_front_end). Spawned otherwise: a restart once the probe listener's
        thread runs (``health_port``)."""
        self.board.front_end_starting(slot)
        args = (self.settings, slot, self.listeners[slot], self.addresses, self.pid, self.board)
        name = f"vitserve-frontend-{slot}"
        if threading.active_count() > 1:
            process = self.spawn.Process(target=processes.front_end, args=args, name=name)
            process.start()
        else:
            process = self.fork.Process(target=self._forked_front_end, args=args, name=name)
            # the supervisor's handlers would run in the child until it drops them: held back
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self.front_ends[slot] = process

    def _forked_front_end(self, settings: Settings, slot: int, *args: object) -> None:
        """In a forked front end: drop what is the supervisor's own, then run the front end. The
        supervisor's signal handlers would stop the service from here, its wake-up pipe would wake
        it, and another front end's listener or the probe port held here would outlive their
        owner's exit."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        for other, listener in enumerate(self.listeners):
            if other != slot:
                listener.close()
        for held in self.grpc_hold:
            held.close()
        for fd in self.wake_pipe:
            os.close(fd)
        if self.probes is not None:
            self.probes.server.socket.close()
        processes.front_end(settings, slot, *args)

    def _backoff(self, who: str) -> float:
        now = time.monotonic()
        recent = [t for t in self.deaths.get(who, []) if now - t < STABLE_S] + [now]
        self.deaths[who] = recent
        return RESTART_BACKOFF_S[min(len(recent) - 1, len(RESTART_BACKOFF_S) - 1)]

    def _retire(self, process: BaseProcess) -> None:
        """A process that ended: its metric files folded into the archive (metrics.py)."""
        from service.observability.metrics import retire_process

        if process.pid is not None:
            retire_process(process.pid, self.metrics_dir)

    def _kill_stalled(self) -> None:
        """Kill each front end whose event loop has ticked, then not for ``KILL_STALLED_S``
        (SIGSTOPped, or stuck in a call that never returns): its listener's connections would wait
        for it forever. Its death is then seen as any other, and it is replaced."""
        now = time.monotonic()
        for slot, process in self.front_ends.items():
            beat, _ = self.board.front_end(slot)
            if beat > STARTING and now - beat >= KILL_STALLED_S and process.is_alive():
                logger.error(
                    "front end %d (pid %s): its event loop has not ticked for %.0f s; killing it",
                    slot,
                    process.pid,
                    now - beat,
                )
                self.board.front_end_starting(slot)
                process.kill()

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.run_dir = run_directory.create()
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        os.mkdir(self.metrics_dir)
        # read by prometheus-client when each process imports it: every value goes to a file there
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        self.addresses = Addresses.in_directory(self.run_dir)
        settings = self.settings
        port = f"HTTP port {settings.server.port}"
        try:
            self.listeners = listen(settings.server.host, settings.server.port, self.count)
            if settings.server.grpc_port:
                port = f"gRPC port {settings.server.grpc_port}"
                self.grpc_hold = hold_grpc(settings.server.host, settings.server.grpc_port)
                if any(is_loose(held) for held in self.grpc_hold):
                    logger.warning(
                        "gRPC port %s: connections of a previous server are in TIME_WAIT; held "
                        "with SO_REUSEADDR until they end (up to a minute)",
                        settings.server.grpc_port,
                    )
            if settings.server.health_port:
                port = f"health port {settings.server.health_port}"
                self.probes = ProbeListener(
                    settings.server.host, settings.server.health_port, self.health
                )
        except OSError as error:
            logger.error(
                "cannot start: cannot listen on %s, %s: %s",
                settings.server.host,
                port,
                error.strerror or error,
            )
            for listener in getattr(self, "listeners", []):
                listener.close()
            for held in self.grpc_hold:
                held.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return processes.EXIT_START_FAILED
        wake_read, wake_write = self.wake_pipe = os.pipe()
        os.set_blocking(wake_write, False)
        previous_wakeup = signal.set_wakeup_fd(wake_write)
        handlers = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        logger.info(
            "vitserve: %d front-end process(es) on http://%s:%d%s, one engine process%s",
            self.count,
            settings.server.host,
            settings.server.port,
            f" and gRPC port {settings.server.grpc_port}" if settings.server.grpc_port else "",
            f"; probes on health port {settings.server.health_port}"
            if settings.server.health_port
            else "",
        )
        code = 0
        try:
            self._start_engine()
            processes.preload_front_end()  # while the engine imports its own
            for slot in range(self.count):
                self._start_front_end(slot)
            if self.probes is not None:  # after the forks: a thread of its own
                self.probes.start()
            code = self._watch(wake_read)
        finally:
            self._shutdown()
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            os.close(wake_read)
            os.close(wake_write)
            if self.probes is not None:  # answered through the drain: not ready, still live
                self.probes.close()
        return code

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        """At once, in the handler: every front end stops being ready and accepting, and the engine
        runs what is queued, before the loop even wakes."""
        if not self.stopping:
            self.stopping = True
            self._begin_drain()

    def _begin_drain(self) -> None:
        self.health.stopping = True
        for process in self.front_ends.values():
            _signal(process, signal.SIGTERM)
        if self.engine is not None:
            _signal(self.engine, signal.SIGUSR1)  # not ready; queued rows run at once

    def _watch(self, wake: int) -> int:
        """Restart what dies until a signal asks to stop; the exit code."""
        while not self.stopping:
            assert self.engine is not None
            watched = {self.engine.sentinel: self.engine}
            watched.update({p.sentinel: p for p in self.front_ends.values()})
            self._kill_stalled()
            self._tighten_grpc_hold()
            for ready in wait([wake, *watched], timeout=1.0):
                if ready == wake:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 512)
                    continue
                process = watched[ready]  # type: ignore[index]
                process.join()
                if self.stopping:
                    break
                self._retire(process)
                if process is self.engine:
                    _, was_ready, ready_pid = self.board.engine()
                    self.board.engine_starting()  # not ready from now, not after its silence
                    if not self.board.engine_ever_started:
                        logger.error(
                            "cannot start: the engine process exited (code %s)", process.exitcode
                        )
                        return processes.EXIT_START_FAILED
                    if was_ready and ready_pid == process.pid:
                        # it had loaded its models and served: not an engine that cannot start,
                        # so no backoff for the deaths before it
                        self.deaths.pop("engine", None)
                    delay = self._backoff("engine")
                    logger.error(
                        "the engine process (pid %s) died (exit code %s); restarting it%s",
                        process.pid,
                        process.exitcode,
                        _after(delay),
                    )
                    time.sleep(delay)
                    self._start_engine()
                else:
                    slot = next(s for s, p in self.front_ends.items() if p is process)
                    delay = self._backoff(f"front end {slot}")
                    logger.error(
                        "front end %d (pid %s) died (exit code %s); restarting it%s",
                        slot,
                        process.pid,
                        process.exitcode,
                        _after(delay),
                    )
                    self.board.front_end_starting(slot)
                    unlink_blocks(self.pid, slot)
                    time.sleep(delay)
                    self._start_front_end(slot)
        return 0

    def _tighten_grpc_hold(self) -> None:
        """Rebind the gRPC port's hold without SO_REUSEADDR once its TIME_WAIT has passed."""
        if any(is_loose(held) for held in self.grpc_hold):
            self.grpc_hold = tighten(self.grpc_hold)
            if not any(is_loose(held) for held in self.grpc_hold):
                logger.info("gRPC port %s: held strictly again", self.settings.server.grpc_port)

    def _shutdown(self) -> None:
        """Front ends drain and exit, then the engine runs what is left and exits."""
        if not self.stopping:  # not asked by a signal (start-up failed): tell them now
            self.stopping = True
            self._begin_drain()
        for listener in getattr(self, "listeners", []):
            listener.close()  # new connections are refused once the front ends close theirs
        front_ends = [p for p in self.front_ends.values() if p.is_alive()]
        drain_s = self.settings.server.graceful_shutdown_s + ANSWER_MARGIN_S
        _join(front_ends, drain_s + KILL_WAIT_S)
        if self.engine is not None:
            _signal(self.engine, signal.SIGTERM)
            _join([self.engine], self.settings.server.graceful_shutdown_s + KILL_WAIT_S)
        for held in self.grpc_hold:  # held until no front end serves gRPC any more
            held.close()
        unlink_blocks(self.pid)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _after(delay_s: float) -> str:
    """How a restart's log line ends: when the restart comes."""
    return f" in {delay_s:g} s" if delay_s else ""


def _signal(process: BaseProcess, sig: int) -> None:
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


def _join(group: list[BaseProcess], timeout_s: float) -> None:
    """Wait for every process of ``group``; kill what is left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for process in group:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in group:
        if process.is_alive():
            logger.error("%s (pid %s) did not stop in time; killing it", process.name, process.pid)
            process.kill()
            process.join()


def serve(settings: Settings) -> int:
    """Run the service as ``settings.link.workers`` asks; the exit code."""
    if settings.link.front_end_count == 0:
        from service.launcher.http_server import serve_http
        from service.launcher.local_app import local_app

        return serve_http(local_app(settings), settings)
    return Supervisor(settings).run()
