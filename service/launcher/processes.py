"""The processes of ``python -m service``: one engine, and the front ends that feed it.

Each process dies with the supervisor (``PR_SET_PDEATHSIG``) and sits in its own process group, so a
terminal's Ctrl-C reaches the supervisor alone, which then stops everything in order. Light to import:
the supervisor imports it, and a spawned child imports it again before anything else. The engine's
modules are imported only by the engine. The web stack (service/launcher/http_server.py) is imported
by the supervisor once the engine has been spawned (:func:`preload_front_end`), and the front ends
forked from it start with it (supervisor.py says when a front end is spawned instead).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile
from typing import TYPE_CHECKING

from service.launcher.cli import EXIT_START_FAILED
from service.launcher.health import ENGINE_BEAT_S, FrontEndBeat, HealthBoard
from service.launcher.process_setup import freeze_heap
from service.link.wire import Addresses
from service.settings import Settings

if TYPE_CHECKING:
    from service.engine.core import Engine

logger = logging.getLogger("vitserve")

# the processes' names (ps, top, /proc/PID/comm)
ENGINE_NAME = "vitserve-engine"
FRONT_END_NAME = "vitserve-front"
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, name: str) -> None:
    """SIGTERM when the supervisor dies, even by kill -9; a group of our own for Ctrl-C; ``name``
    as the process's name in ps and top (at most 15 bytes)."""
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        libc.prctl(_PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):  # not Linux: the front ends' engine watch still notices
        pass
    if os.getppid() != parent:  # the supervisor died before the line above
        sys.exit(1)


def private_temporary_files(addresses: Addresses) -> None:
    """This process's temporary files in the supervisor's private run directory, which goes when the
    service stops, or when the next service starts after a kill -9 (run_directory.py): uploads
    spooled by a front end, and what libraries write to TMPDIR (onnxruntime writes a session file,
    ``.ses``, there when it is imported)."""
    directory = os.path.dirname(addresses.engine)
    os.environ["TMPDIR"] = directory  # for native code, and the processes this one starts
    tempfile.tempdir = directory  # Python's cache of it, copied from the supervisor by a fork


def front_end(
    settings: Settings,
    slot: int,
    listener: socket.socket,
    addresses: Addresses,
    parent: int,
    board: HealthBoard,
) -> None:
    """A front-end process: HTTP on its listener, gRPC on the shared port, the engine linked.
    It serves once the engine has started (loaded its models) for the first time, as a single
    process does; after that it stays up while the engine restarts, answering 503."""
    die_with_parent(parent, f"{FRONT_END_NAME}{slot}")
    private_temporary_files(addresses)
    create_app, serve_http, block_name, RemoteEngine, Metrics = _front_end_modules()
    metrics = Metrics()
    engine = RemoteEngine(
        addresses,
        block_name(parent, slot, os.getpid()),
        settings.link.arena_mib * 2**20,
        settings.limits.retry_after_s,
        metrics,
    )
    app = create_app(settings, engine=engine, worker=slot, process_metrics=metrics)
    board.wait_for_engine()
    state = app.state.frontend
    beat = FrontEndBeat(board, slot, lambda: (engine.engine_pid or 0) if state.ready else 0)
    sys.exit(serve_http(app, settings, [listener], beat))


def preload_front_end() -> None:
    """Import, in the supervisor, what every front end runs, so that a front end forked from it
    starts with them (supervisor.py): two front ends each importing the web stack for about a
    second of CPU, beside the engine's own imports, was most of start-up on two cores. Frozen: the
    front ends' collections then never walk (and so copy) the pages they share with the supervisor."""
    _front_end_modules()
    freeze_heap()


def _front_end_modules() -> tuple:
    """What a front end runs, imported: one list for :func:`front_end` and :func:`preload_front_end`."""
    from service.frontend.app import create_app
    from service.launcher.http_server import serve_http
    from service.link.arena import block_name
    from service.link.remote import RemoteEngine
    from service.observability.metrics import Metrics

    return create_app, serve_http, block_name, RemoteEngine, Metrics


def engine(settings: Settings, addresses: Addresses, parent: int, board: HealthBoard) -> None:
    """The engine process: every model, one batcher per version, fed by every front end."""
    die_with_parent(parent, ENGINE_NAME)
    private_temporary_files(addresses)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the engine stops
    from service.observability import logs

    logs.configure(settings.server.log_level, settings.server.log_format)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        run = asyncio.run
    sys.exit(run(_serve_engine(settings, addresses, board)))


async def _report_health(board: HealthBoard, core: Engine) -> None:
    """The engine's readiness on the supervisor's board, and the proof that its loop ticks."""
    pid = os.getpid()
    while True:
        board.engine_beat(core.ready, pid)
        await asyncio.sleep(ENGINE_BEAT_S)


async def _serve_engine(settings: Settings, addresses: Addresses, board: HealthBoard) -> int:
    from service.contract.model_repository import ModelLoadError
    from service.engine.core import Engine
    from service.engine.server import EngineServer
    from service.observability import tracing
    from service.observability.metrics import Metrics

    provider = tracing.provider_from_environment(os.environ)
    tracing.activate(provider)
    core = Engine(settings, Metrics())
    server = EngineServer(core, addresses)
    await server.bind()  # first: the front ends see a table (not ready) while the models load
    reporting = asyncio.get_running_loop().create_task(_report_health(board, core))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, core.begin_shutdown)  # the front ends are draining
    try:
        await core.start()
    except ModelLoadError:
        reporting.cancel()
        await server.close()
        return EXIT_START_FAILED
    freeze_heap()
    board.engine_started()
    await stop.wait()
    await core.stop()
    reporting.cancel()
    await server.close()
    if provider is not None:
        provider.shutdown()
    return 0
