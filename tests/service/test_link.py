"""The process link's messages: what one turn of the event loop has ready goes as one message, items come
out in order with their raw frames however the bytes arrive, a cancel that travels with its call still
cancels it, answers reach the front end that asked, a front end that goes away has its calls cancelled, and a
front end connects again to a restarted engine."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from service.engine.table import ModelTable
from service.link import wire
from service.link.arena import PAGE, Arena
from service.link.engine_server import EngineServer
from service.link.remote import RemoteEngine
from service.observability.metrics import Metrics


def raw_bytes(raw: list) -> list[bytes]:
    return [bytes(frame) for frame in raw]


ITEMS = [
    ((wire.INFER, (1, "m")), [b"rows-1"]),
    ((wire.CANCEL, 7), []),
    ((wire.INFER, (2, "m")), [b"rows-2a", np.arange(6, dtype=np.float32).reshape(2, 3).data]),
    ((wire.FAILED, ("m", 1, 5)), []),
]
EXPECTED = [
    ((wire.INFER, (1, "m")), [b"rows-1"]),
    ((wire.CANCEL, 7), []),
    ((wire.INFER, (2, "m")), [b"rows-2a", np.arange(6, dtype=np.float32).tobytes()]),
    ((wire.FAILED, ("m", 1, 5)), []),
]


def test_items_come_out_in_order_with_their_own_raw_frames():
    message = memoryview(wire.pack(ITEMS))
    out = [(header, raw_bytes(raw)) for header, raw in wire.unpack(message)]
    assert out == EXPECTED


@pytest.mark.parametrize("pieces", ["whole", "bytes", "random"])
def test_messages_come_out_whole_however_their_bytes_arrive(pieces):
    """A stream hands over bytes, not messages: a message split anywhere, or several in one read,
    still comes out whole and in order."""
    stream = b"".join(wire.pack(ITEMS[: n + 1]) for n in range(len(ITEMS)))
    if pieces == "whole":
        chunks = [stream]
    elif pieces == "bytes":
        chunks = [stream[i : i + 1] for i in range(len(stream))]
    else:
        rng, chunks, at = random.Random(7), [], 0
        while at < len(stream):
            size = rng.randint(1, 40)
            chunks.append(stream[at : at + size])
            at += size
    seen: list = []

    async def scenario():
        link = wire.Link(lambda _, header, raw: seen.append((header, raw_bytes(raw))))
        for chunk in chunks:
            link.data_received(chunk)

    asyncio.run(scenario())
    assert seen == [item for n in range(len(EXPECTED)) for item in EXPECTED[: n + 1]]


def test_an_item_its_handler_refuses_does_not_stop_the_link(caplog):
    seen: list = []

    def take(_: wire.Link, header: tuple, raw: list) -> None:
        if header == "bad":
            raise ValueError("an item its handler cannot take")
        seen.append(header)

    async def scenario():
        link = wire.Link(take)
        link.data_received(wire.pack([("one", []), ("bad", []), ("two", [])]))
        link.data_received(wire.pack([("three", [])]))

    asyncio.run(scenario())
    assert seen == ["one", "two", "three"]
    assert "could not be handled" in caplog.text


def test_what_one_loop_turn_puts_goes_as_one_message():
    sent: list[bytes] = []

    async def scenario():
        outbox = wire.Outbox(sent.append)
        outbox.put(("a", 1), b"x")
        outbox.put(("b", 2))
        outbox.put(("c", 3), b"y", b"z")
        assert sent == []  # nothing leaves before the loop has run what was ready
        await asyncio.sleep(0)
        outbox.put(("d", 4))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(sent) == 2
    first, second = (list(wire.unpack(memoryview(message))) for message in sent)
    assert [h for h, _ in first] == [("a", 1), ("b", 2), ("c", 3)]
    assert raw_bytes(first[2][1]) == [b"y", b"z"]
    assert [h for h, _ in second] == [("d", 4)]


def test_a_lone_item_goes_at_once_and_never_ahead_of_one_already_waiting():
    sent: list[bytes] = []

    async def scenario():
        outbox = wire.Outbox(sent.append)
        outbox.put(("lone", 1), b"x", at_once=True)
        assert len(sent) == 1  # not held for the loop's next turn
        outbox.put(("a", 2))
        outbox.put(("b", 3), at_once=True)  # behind "a": waits with it, order kept
        assert len(sent) == 1
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [[h for h, _ in wire.unpack(memoryview(message))] for message in sent] == [
        [("lone", 1)],
        [("a", 2), ("b", 3)],
    ]
    assert raw_bytes(next(wire.unpack(memoryview(sent[0])))[1]) == [b"x"]


def infer_header(call_id: int, rows: np.ndarray) -> tuple:
    """An INFER header (service/link/remote.py's order) for rows sent inline."""
    return (call_id, "m", 1, None, ("k",), "classifier", None, None, 0, rows.shape, rows.dtype.str,
            None)  # fmt: skip


READY = ModelTable(phase="ready", healthy=True, retry_after_s=1)


class CancelWatchingEngine:
    """An engine whose calls report whether the client-gone signal had completed when they were
    waited for, and, told to ``hold``, wait for that signal before answering; told to run ``inline``,
    a call that came alone is answered at once (as an idle fast model's lone image is)."""

    def __init__(self, hold: bool = False, inline: bool = False) -> None:
        self.gone_at_start: list[bool] = []
        self.alone: list[bool] = []
        self.hold = hold
        self.inline = inline
        self.released = 0
        self.current = READY

    def call(self, name, version, requested, key, graph, rows, request_id, alone):
        self.alone.append(alone)
        return WatchedCall(self, [np.full((len(rows), 2), rows.sum(), np.float32)], alone)

    def table(self) -> ModelTable:
        return self.current


class WatchedCall:
    def __init__(self, engine: CancelWatchingEngine, outputs: list, alone: bool) -> None:
        self.engine = engine
        self._outputs = outputs
        self.answered = alone and engine.inline

    def outputs(self) -> list:
        return self._outputs

    async def wait(self, gone: asyncio.Future) -> list:
        self.engine.gone_at_start.append(gone.done())
        if self.engine.hold:
            await gone
            self.engine.released += 1
        return self._outputs


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_cancel_in_the_same_message_as_its_call_reaches_it(tmp_path, cancelled):
    engine = CancelWatchingEngine()
    rows = np.zeros((1, 1, 2, 2), np.float32)

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = wire.Link(lambda *_: None)  # never connected: its answers go nowhere
        items = [((wire.INFER, infer_header(5, rows)), [rows.tobytes()])]
        if cancelled:
            items.append(((wire.CANCEL, 5), []))
        # one message's items, handed over as the server's links hand them
        for header, raw in wire.unpack(memoryview(wire.pack(items))):
            server._take(link, header, raw)
        await asyncio.sleep(0)  # the loop's next turn starts them
        await asyncio.gather(*server._running)
        await server.close()

    asyncio.run(scenario())
    assert engine.gone_at_start == [cancelled]


def test_only_a_call_with_no_other_in_progress_is_run_alone(tmp_path):
    """The engine tells the batcher a call is alone (start it now) only when no other call came with
    it or is still in progress; calls that came together may share a batch."""
    engine = CancelWatchingEngine()
    rows = np.zeros((1, 1, 2, 2), np.float32)

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = wire.Link(lambda *_: None)
        for call_ids in ((1,), (2, 3), (4,)):
            items = [((wire.INFER, infer_header(i, rows)), [rows.tobytes()]) for i in call_ids]
            for header, raw in wire.unpack(memoryview(wire.pack(items))):
                server._take(link, header, raw)
            await asyncio.sleep(0)  # the loop's next turn starts them
            await asyncio.gather(*server._running)
        await server.close()

    asyncio.run(scenario())
    assert engine.alone == [True, False, False, True]


def test_calls_from_two_front_ends_in_one_turn_are_not_alone_and_a_lone_one_is_answered_at_once(
    tmp_path,
):
    """Calls that arrive in one turn of the loop from different front ends may share a batch, so
    neither is alone; a lone call the engine answered at once is answered without a task."""
    engine = CancelWatchingEngine(inline=True)
    rows = np.ones((1, 1, 2, 2), np.float32)
    sent: list[list] = [[], []]

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        links = [wire.Link(lambda *_: None) for _ in sent]
        for link, messages in zip(links, sent, strict=True):
            link.outbox = wire.Outbox(messages.append)
        for call_id, link in enumerate(links, start=1):  # two front ends, one turn
            server._take(link, (wire.INFER, infer_header(call_id, rows)), [rows.tobytes()])
        await asyncio.sleep(0)
        tasks_for_two = len(server._running)
        await asyncio.gather(*server._running)
        await asyncio.sleep(0)  # the answers' flush
        server._take(links[0], (wire.INFER, infer_header(3, rows)), [rows.tobytes()])
        await asyncio.sleep(0)
        tasks_for_one = len(server._running)
        await server.close()
        return tasks_for_two, tasks_for_one, server._gone

    tasks_for_two, tasks_for_one, gone = asyncio.run(scenario())
    assert engine.alone == [False, False, True]
    assert tasks_for_two == 2 and tasks_for_one == 0 and not gone
    answered = [
        [header for message in messages for header, _ in wire.unpack(memoryview(message))]
        for messages in sent
    ]
    assert [[(call_id, ok) for call_id, ok, _ in got] for got in answered] == [
        [(1, True), (3, True)],
        [(2, True)],
    ]


async def connect(path: str, received: list) -> wire.Link:
    """A front end's connection to the engine server at ``path``, recording every answer."""
    loop = asyncio.get_running_loop()
    _, link = await loop.create_unix_connection(
        lambda: wire.Link(lambda _, answer, raw: received.append((answer, raw_bytes(raw)))), path
    )
    return link


async def until(condition, seconds: float = 10) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.005)


def test_answers_and_tables_reach_the_front_end_that_asked(tmp_path):
    """Over real sockets: two front ends, two calls each in one message; each gets the table on
    connecting and whenever it changes, and its own answers only."""
    engine = CancelWatchingEngine()
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario():
        server = EngineServer(engine, addresses)
        await server.bind()
        answers: dict[str, list] = {"a": [], "b": []}
        links = {key: await connect(addresses.engine, got) for key, got in answers.items()}
        for offset, link in enumerate(links.values()):
            link.outbox.put((wire.TABLE, None))
            for call_id in (11, 12):
                rows = np.full((1, 1, 2, 2), call_id + offset * 100, np.float32)
                link.outbox.put((wire.INFER, infer_header(call_id, rows)), rows.data)

        def answered() -> bool:
            return all(
                len([a for a in got if a[0][0] != wire.TABLE_CALL]) == 2 for got in answers.values()
            )

        await until(answered)
        engine.current = replace(READY, phase="shutting_down", generation=READY.generation + 1)

        def told(got: list) -> bool:
            return any(
                c == wire.TABLE_CALL and p[1].phase == "shutting_down" for (c, _, p), _ in got
            )

        await until(lambda: all(told(got) for got in answers.values()))
        for link in links.values():
            link.close()
        await server.close()
        return answers

    answers = asyncio.run(scenario())
    for offset, key in enumerate(("a", "b")):
        tables = [
            payload for (call_id, _, payload), _ in answers[key] if call_id == wire.TABLE_CALL
        ]
        assert tables and tables[0][1] == READY
        calls = {call_id: (ok, raw) for (call_id, ok, _), raw in answers[key] if call_id}
        assert sorted(calls) == [11, 12]
        for call_id, (ok, raw) in calls.items():
            sum_of_rows = 4 * (call_id + offset * 100)  # what the engine answers for these rows
            assert ok and np.frombuffer(raw[0], np.float32).tolist() == [sum_of_rows] * 2


def test_a_front_end_that_goes_away_has_its_calls_cancelled(tmp_path):
    """Nobody will read the answers of a front end that died: its calls' rows need not run."""
    engine = CancelWatchingEngine(hold=True)
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario():
        server = EngineServer(engine, addresses)
        await server.bind()
        staying, leaving = [], []
        stays = await connect(addresses.engine, staying)
        leaves = await connect(addresses.engine, leaving)
        rows = np.zeros((1, 1, 2, 2), np.float32)
        for link in (stays, leaves):
            link.outbox.put((wire.INFER, infer_header(3, rows)), rows.data)
        await until(lambda: len(engine.gone_at_start) == 2)
        leaves.transport.abort()  # as when its process is killed
        await until(lambda: engine.released == 1)
        await asyncio.sleep(0.05)
        held = engine.released
        stays.close()
        await until(lambda: engine.released == 2)
        await server.close()
        return held

    assert asyncio.run(scenario()) == 1  # the other front end's call still waited


def test_the_engine_lets_go_of_a_gone_front_end_s_shared_memory(tmp_path):
    """A front end that died is replaced by one with a block of its own: the engine unmaps the dead
    one's block instead of holding its pages for the rest of its life."""
    engine = CancelWatchingEngine()
    addresses = wire.Addresses.in_directory(str(tmp_path))
    arena = Arena(f"vitserve-test-{os.getpid()}-link", 16 * PAGE)

    def mapped() -> bool:
        return arena.name in Path(f"/proc/{os.getpid()}/maps").read_text()

    async def scenario() -> list[bool]:
        seen = []
        server = EngineServer(engine, addresses)
        await server.bind()
        answers: list = []
        link = await connect(addresses.engine, answers)
        rows = np.ones((1, 1, 2, 2), np.float32)
        region = arena.put(rows)
        header = list(infer_header(1, rows))
        header[7:9] = [arena.name, region.offset]  # the rows in the block, not in the message
        link.outbox.put((wire.INFER, tuple(header)))
        await until(lambda: answers)
        arena.close()  # unlinked, and unmapped here: only the engine's mapping is left
        seen.append(mapped())
        link.transport.abort()
        await until(lambda: not mapped())
        seen.append(mapped())
        await server.close()
        return seen

    assert asyncio.run(scenario()) == [True, False]


def test_a_front_end_connects_again_to_a_restarted_engine(tmp_path):
    """The engine's socket goes away with it: the front end answers 503 meanwhile, connects to the
    next engine when it listens, takes its table and runs calls again."""
    addresses = wire.Addresses.in_directory(str(tmp_path))
    view = SimpleNamespace(name="m", version=1, preprocessing_key=("k",))  # what infer reads

    async def scenario() -> list:
        seen = []
        first = EngineServer(CancelWatchingEngine(), addresses)
        await first.bind()
        remote = RemoteEngine(addresses, "unused", 0, 1, Metrics())
        await remote.start()
        rows = np.ones((1, 1, 2, 2), np.float32)
        seen.append(await remote.infer(view, None, "classifier", rows, None, None))
        await first.close()
        # the lost link says so at once, not the heartbeat (silent for SILENT_ENGINE_S = 3 s)
        await until(lambda: not remote.connected, seconds=2)
        try:
            await remote.infer(view, None, "classifier", rows, None, None)
        except Exception as error:  # its kind is what is checked
            seen.append(getattr(error, "code", repr(error)))
        second = EngineServer(CancelWatchingEngine(), addresses)
        await second.bind()
        await until(lambda: remote.connected and remote.table.ready)
        seen.append(await remote.infer(view, None, "classifier", rows * 2, None, None))
        await remote.stop()
        await second.close()
        return seen

    first_answer, refused, second_answer = asyncio.run(scenario())
    assert first_answer[0].tolist() == [[4.0, 4.0]]
    assert refused == "engine_unavailable"
    assert second_answer[0].tolist() == [[8.0, 8.0]]


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
