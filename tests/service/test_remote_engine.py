"""The front end's side of the link (``RemoteEngine``): an answered call is forgotten, a lone call goes at
once however many came before it, a call the engine never answers is given up at its deadline with a 503
(its arena region freed, the engine told to drop it), control calls come back typed, no module a front
end runs imports the engine, a front end connects again to a restarted engine, a request that comes meanwhile waits for it
(for a while), and a table a dead engine sent never makes it ready."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from service.contract.table import Call, ModelTable
from service.engine.server import EngineServer
from service.errors import InvalidInput, ServiceUnavailable
from service.link import remote as remote_module
from service.link import wire
from service.link.arena import block_name
from service.link.protocol import Infer
from service.link.remote import RemoteEngine
from service.observability.metrics import Metrics
from tests.service.test_arena import whole_again
from tests.service.test_link import CancelWatchingEngine, until
from tests.support import REPO

ROWS = np.ones((1, 1, 2, 2), np.float32)


def view(timeout_s: float = 5.0) -> SimpleNamespace:
    """What ``RemoteEngine.infer`` reads of a version."""
    return SimpleNamespace(
        name="m",
        version=1,
        preprocessing_key=7,
        serving=SimpleNamespace(request_timeout_s=timeout_s),
    )


async def started(engine, tmp_path) -> tuple[EngineServer, RemoteEngine]:
    addresses = wire.Addresses.in_directory(str(tmp_path))
    server = EngineServer(engine, addresses)
    await server.bind()
    remote = RemoteEngine(
        addresses, block_name(os.getppid(), 0, os.getpid()), 16 * 4096, 1, Metrics()
    )
    await remote.start()
    await until(lambda: remote.connected and remote.table.ready)
    return server, remote


def test_answered_calls_are_forgotten_and_each_lone_call_goes_at_once(tmp_path, monkeypatch):
    """A client calling one request after another: every call leaves nothing behind once
    answered, and every one of them, not only the first, is sent at once rather than in the
    loop's next turn (the lone-call fast path)."""
    sent_at_once: list[bool] = []
    put = wire.Outbox.put

    def recording(self, message, *raw, at_once=False):
        if isinstance(message, Infer):
            sent_at_once.append(at_once)
        put(self, message, *raw, at_once=at_once)

    monkeypatch.setattr(wire.Outbox, "put", recording)

    async def scenario() -> tuple[list, int, bool]:
        server, remote = await started(CancelWatchingEngine(), tmp_path)
        answers = [await remote.infer(Call(view(), None, "classifier", ROWS)) for _ in range(6)]
        pending, whole = len(remote._pending), whole_again(remote.arena)
        await remote.stop()
        await server.close()
        return answers, pending, whole

    answers, pending, whole = asyncio.run(scenario())
    assert [answer[0].tolist() for answer in answers] == [[[4.0, 4.0]]] * 6
    assert pending == 0 and whole
    assert sent_at_once == [True] * 6


def test_a_call_the_engine_never_answers_is_given_up_at_its_deadline(tmp_path, monkeypatch):
    """An engine that holds a call (stalled, or its answer lost): at the version's request timeout
    and the grace after it, the client gets 503 engine_timeout with Retry-After, the call and its
    arena region are let go, and the engine is told to drop it; the next call is served."""
    monkeypatch.setattr(remote_module, "DEADLINE_GRACE_S", 0.05)
    engine = CancelWatchingEngine(hold=True)

    async def scenario():
        server, remote = await started(engine, tmp_path)
        try:
            async with asyncio.timeout(10):  # not for ever, should the deadline never come
                await remote.infer(Call(view(timeout_s=0.1), None, "classifier", ROWS))
        except ServiceUnavailable as error:
            refused = error
        held = (len(remote._pending), whole_again(remote.arena))
        await until(lambda: engine.released == 1)  # the engine's call was cancelled
        engine.hold = False
        again = await remote.infer(Call(view(), None, "classifier", ROWS))
        await remote.stop()
        await server.close()
        return refused, held, again

    refused, held, again = asyncio.run(scenario())
    assert refused.code == "engine_timeout" and refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert held == (0, True)
    assert again[0].tolist() == [[4.0, 4.0]]


def test_control_calls_come_back_as_their_operation_s_type(tmp_path):
    class Controlled(CancelWatchingEngine):
        async def control(self, op, **arguments):
            if op == "index":
                return [("m", 1, "READY", ""), ("n", None, "UNAVAILABLE", "unloaded")]
            return {"op": op, **arguments}

    async def scenario():
        server, remote = await started(Controlled(), tmp_path)
        index = await remote.index()
        config = await remote.config("m", 2)
        await remote.stop()
        await server.close()
        return index, config

    index, config = asyncio.run(scenario())
    assert index == [("m", 1, "READY", ""), ("n", None, "UNAVAILABLE", "unloaded")]
    assert config == {"op": "config", "name": "m", "version": 2}


def test_no_module_a_front_end_runs_imports_the_engine():
    """Front ends share the protocol and the table with the engine, never its code: importing every
    front-end module, every module of the link and the table loads nothing from ``service/engine/``
    (nor onnxruntime). The engine's end of the link and the in-process engine are the engine's."""
    script = """
import pkgutil, importlib, sys
import service.frontend, service.link
for package in (service.frontend, service.link):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
importlib.import_module("service.contract.table")
print(sorted(m for m in sys.modules if m.startswith("service.engine") or m == "onnxruntime"))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def engine_imports(path: Path) -> list[str]:
    """Every import of ``service.engine`` (or a module of it) in ``path``, at any depth: an import
    inside a function loads the engine as surely as one at the top, only later."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name in names
                  if name == "service.engine" or name.startswith("service.engine.")]  # fmt: skip
    return found


def test_no_front_end_module_imports_the_engine_even_in_a_function():
    """The front end is given its engine (service/launcher/local_app.py builds the in-process one):
    no module of the front end, the link or the contract names ``service/engine/`` in an import,
    even one inside a function that the test above never calls."""
    files = [
        path
        for package in ("frontend", "link", "contract")
        for path in sorted((REPO / "service" / package).rglob("*.py"))
    ]
    assert any(path.name == "app.py" for path in files)  # the files are read, not none
    assert [found for path in files for found in engine_imports(path)] == []


def test_a_front_end_connects_again_to_a_restarted_engine(tmp_path):
    """The engine's socket goes away with it: the front end answers 503 meanwhile, connects to the
    next engine when it listens, takes its table and runs calls again."""
    addresses = wire.Addresses.in_directory(str(tmp_path))
    view = SimpleNamespace(  # what infer reads
        name="m",
        version=1,
        preprocessing_key=7,
        serving=SimpleNamespace(request_timeout_s=5),
    )

    async def scenario() -> list:
        seen = []
        first = EngineServer(CancelWatchingEngine(), addresses)
        await first.bind()
        remote = RemoteEngine(addresses, "unused", 0, 1, Metrics())
        await remote.start()
        rows = np.ones((1, 1, 2, 2), np.float32)
        seen.append(await remote.infer(Call(view, None, "classifier", rows)))
        await first.close()
        # the lost link says so at once, not the heartbeat (silent for SILENT_ENGINE_S = 3 s)
        await until(lambda: not remote.connected, seconds=2)
        try:
            await remote.infer(Call(view, None, "classifier", rows))
        except Exception as error:  # its kind is what is checked
            seen.append(getattr(error, "code", repr(error)))
        second = EngineServer(CancelWatchingEngine(), addresses)
        await second.bind()
        await until(lambda: remote.connected and remote.table.ready)
        seen.append(await remote.infer(Call(view, None, "classifier", rows * 2)))
        await remote.stop()
        await second.close()
        return seen

    first_answer, refused, second_answer = asyncio.run(scenario())
    assert first_answer[0].tolist() == [[4.0, 4.0]]
    assert refused == "engine_unavailable"
    assert second_answer[0].tolist() == [[8.0, 8.0]]


def test_a_request_while_the_engine_restarts_waits_for_the_next_engine_s_table(
    tmp_path, monkeypatch
):
    """With no engine running, a request is routed by the next engine's first table when it comes
    within ENGINE_WAIT_S, and then runs on it; past that, by the placeholder (503 not_ready)."""
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario() -> dict[str, object]:
        seen: dict[str, object] = {}
        first = EngineServer(CancelWatchingEngine(), addresses)
        await first.bind()
        remote = RemoteEngine(addresses, "unused", 0, 1, Metrics())
        await remote.start()
        await first.close()
        await until(lambda: not remote.connected, seconds=2)
        monkeypatch.setattr(remote_module, "ENGINE_WAIT_S", 0.3)
        began = time.monotonic()
        alone = await remote.table_to_route_by()
        seen["no engine: waited"] = time.monotonic() - began
        seen["no engine: ready"] = alone.ready
        monkeypatch.setattr(remote_module, "ENGINE_WAIT_S", 30.0)
        waiting = asyncio.ensure_future(remote.table_to_route_by())
        await asyncio.sleep(0.3)
        seen["before the engine: done"] = waiting.done()
        second = EngineServer(CancelWatchingEngine(), addresses)
        await second.bind()
        seen["next engine: ready"] = (await asyncio.wait_for(waiting, 10)).ready
        seen["answer"] = (await remote.infer(Call(view(), None, "classifier", ROWS)))[0]
        began = time.monotonic()
        await remote.table_to_route_by()
        seen["running engine: waited"] = time.monotonic() - began
        await remote.stop()
        await second.close()
        return seen

    seen = asyncio.run(scenario())
    assert 0.3 <= seen.pop("no engine: waited") < 5
    assert seen.pop("running engine: waited") < 0.1
    assert seen.pop("answer").tolist() == [[4.0, 4.0]]
    assert seen == {
        "no engine: ready": False,
        "before the engine: done": False,
        "next engine: ready": True,
    }


def test_a_request_waits_while_the_restarted_engine_loads_its_models(tmp_path):
    """A restarted engine publishes its table while its first load runs (phase "starting"): a
    request waits for the table that says it has started, not only for the engine to answer."""
    started = ModelTable(phase="ready", healthy=True, retry_after_s=1)

    async def scenario() -> list[bool]:
        remote = RemoteEngine(wire.Addresses.in_directory(str(tmp_path)), "unused", 0, 1, Metrics())
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            remote._take_table((engine.pid, 1), ModelTable(phase="starting", retry_after_s=1))
            waiting = asyncio.ensure_future(remote.table_to_route_by())
            await asyncio.sleep(0.3)
            seen = [waiting.done()]
            remote._take_table((engine.pid, 1), started)
            seen.append((await asyncio.wait_for(waiting, 5)).ready)
            return seen
        finally:
            engine.kill()
            engine.wait()
            remote._unwatch()

    assert asyncio.run(scenario()) == [False, True]


def test_a_table_its_dead_engine_sent_never_makes_the_front_end_ready(tmp_path):
    """A table published just before the engine died can be read after its death was seen: it must not
    make the front end ready again (it would send calls to nobody), nor may the table of an engine
    already gone when it is read; the next engine's table does, even on the same pid."""
    ready = ModelTable(phase="ready", healthy=True, retry_after_s=1)

    async def scenario() -> list[bool]:
        remote = RemoteEngine(wire.Addresses.in_directory(str(tmp_path)), "unused", 0, 1, Metrics())
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        seen = []
        remote._take_table((engine.pid, 1), ready)
        seen.append(remote.connected and remote.table.ready)
        engine.kill()  # not reaped yet, as when the supervisor has not come to it
        await until(lambda: not remote.connected)  # its death, seen through its pidfd
        remote._take_table((engine.pid, 1), ready)  # the table it sent before dying
        seen.append(remote.connected or remote.table.ready)
        engine.wait()
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        remote._take_table((gone.pid, 2), ready)  # an engine that died before its table was read
        seen.append(remote.connected or remote.table.ready)
        again = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        remote._take_table((again.pid, 3), ready)
        seen.append(remote.connected and remote.table.ready)
        remote._take_table((engine.pid, 1), ready)  # a stale one read late changes nothing
        seen.append(remote.engine_pid == again.pid)
        again.kill()
        again.wait()
        remote._unwatch()
        return seen

    assert asyncio.run(scenario()) == [True, False, False, True, True]


def test_a_call_that_cannot_be_encoded_is_refused_alone_and_its_partners_are_answered(tmp_path):
    """``promote?version=<23 digits>`` went into the outbox with other calls: the message failed
    to encode, every call in it was dropped and each caller waited for ever. Now that call alone is
    refused (422) and the calls sent with it are answered."""

    class Controlled(CancelWatchingEngine):
        async def control(self, op, **arguments):
            return {"op": op, **arguments}

    async def scenario():
        server, remote = await started(Controlled(), tmp_path)
        async with asyncio.timeout(30):  # a dropped call would wait for ever
            results = await asyncio.gather(
                remote.config("m", 1),  # alone: it goes at once
                remote.promote("m", 10**23),  # these two share a message
                remote.config("m", 2),
                return_exceptions=True,
            )
        pending = len(remote._pending)
        await remote.stop()
        await server.close()
        return results, pending

    (first, refused, partner), pending = asyncio.run(scenario())
    assert first == {"op": "config", "name": "m", "version": 1}
    assert isinstance(refused, InvalidInput) and refused.code == "unsendable_call", refused
    assert partner == {"op": "config", "name": "m", "version": 2}
    assert pending == 0
