"""The process link's messages: what one turn of the event loop has ready goes as one message, items come
out in order with their raw frames however the bytes arrive, a cancel that travels with its call still
cancels it, answers reach the front end that asked, and a front end that goes away has its calls cancelled
and its shared memory let go."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
from msgspec.structs import replace

from service.contract.control import OPERATIONS, ControlOp
from service.contract.table import ModelTable
from service.engine.server import EngineServer
from service.link import protocol, wire
from service.link.arena import PAGE, Arena, block_name
from service.link.protocol import Answer, Cancel, Failed, Hello, Infer, TableUpdate


def raw_bytes(raw: list) -> list[bytes]:
    return [bytes(frame) for frame in raw]


def infer(call_id: int, rows: np.ndarray, offset: int | None = None) -> Infer:
    """A call for model "m" version 1, its rows inline (``offset`` None) or in the arena."""
    return Infer(call_id, "m", 1, None, 7, "classifier", rows.shape, rows.dtype.str, offset)


ROWS = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
ITEMS = [
    (infer(1, ROWS), [b"rows-1"]),
    (Cancel(7), []),
    (infer(2, ROWS), [b"rows-2a", np.arange(6, dtype=np.float32).reshape(2, 3).data]),
    (Failed("m", 1, 5), []),
]
EXPECTED = [
    (infer(1, ROWS), [b"rows-1"]),
    (Cancel(7), []),
    (infer(2, ROWS), [b"rows-2a", np.arange(6, dtype=np.float32).tobytes()]),
    (Failed("m", 1, 5), []),
]


def unpacked(message: bytes, decoder=wire.to_engine) -> list:
    return [(item, raw_bytes(raw)) for item, raw in wire.unpack(memoryview(message), decoder)]


def test_items_come_out_in_order_with_their_own_raw_frames():
    assert unpacked(wire.pack(ITEMS)) == EXPECTED


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

    def take(_: wire.Link, items: list) -> None:
        seen.extend((item, raw_bytes(raw)) for item, raw in items)

    async def scenario():
        link = wire.Link(wire.to_engine, take)
        for chunk in chunks:
            link.data_received(chunk)

    asyncio.run(scenario())
    assert seen == [item for n in range(len(EXPECTED)) for item in EXPECTED[: n + 1]]


def test_a_message_its_handler_fails_on_does_not_stop_the_link(caplog):
    seen: list = []

    def take(_: wire.Link, items: list) -> None:
        if any(isinstance(item, Cancel) for item, _ in items):
            raise RuntimeError("a fault of this side")
        seen.extend(item for item, _ in items)

    async def scenario():
        link = wire.Link(wire.to_engine, take)
        link.data_received(wire.pack([(Failed("m", 1, 1), [])]))
        link.data_received(wire.pack([(Cancel(3), [])]))
        link.data_received(wire.pack([(Failed("m", 1, 2), [])]))

    asyncio.run(scenario())
    assert seen == [Failed("m", 1, 1), Failed("m", 1, 2)]
    assert "could not be handled" in caplog.text


def test_what_one_loop_turn_puts_goes_as_one_message():
    sent: list[bytes] = []

    async def scenario():
        outbox = wire.Outbox(sent.append)
        outbox.put(Cancel(1), b"x")
        outbox.put(Cancel(2))
        outbox.put(Cancel(3), b"y", b"z")
        assert sent == []  # nothing leaves before the loop has run what was ready
        await asyncio.sleep(0)
        outbox.put(Cancel(4))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(sent) == 2
    first, second = (unpacked(message) for message in sent)
    assert [item for item, _ in first] == [Cancel(1), Cancel(2), Cancel(3)]
    assert first[2][1] == [b"y", b"z"]
    assert [item for item, _ in second] == [Cancel(4)]


def test_a_lone_item_goes_at_once_and_never_ahead_of_one_already_waiting():
    sent: list[bytes] = []

    async def scenario():
        outbox = wire.Outbox(sent.append)
        outbox.put(Cancel(1), b"x", at_once=True)
        assert len(sent) == 1  # not held for the loop's next turn
        outbox.put(Cancel(2))
        outbox.put(Cancel(3), at_once=True)  # behind 2: waits with it, order kept
        assert len(sent) == 1
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [[item for item, _ in unpacked(message)] for message in sent] == [
        [Cancel(1)],
        [Cancel(2), Cancel(3)],
    ]
    assert unpacked(sent[0])[0][1] == [b"x"]


READY = ModelTable(phase="ready", healthy=True, retry_after_s=1)


def hello(server: EngineServer, sent: list | None = None) -> wire.Link:
    """A front end's link that has said hello to ``server`` without a socket: what the server
    sends it is appended to ``sent``."""
    link = wire.Link(wire.to_front_end, lambda *_: None)
    if sent is not None:
        link.outbox = wire.Outbox(sent.append)
    server.take(link, [(Hello(None), [])])
    return link


class CancelWatchingEngine:
    """An engine whose requests report, as they are answered, whether their client had gone
    (``gone_at_start``), and, told to ``hold``, are answered only once it has; told to run
    ``inline``, a request that came alone is answered at once (as an idle fast model's lone image
    is), else in the loop's next turn (as a batch's requests are)."""

    def __init__(self, hold: bool = False, inline: bool = False) -> None:
        self.gone_at_start: list[bool] = []
        self.alone: list[bool] = []
        self.routes: list[tuple] = []
        self.hold = hold
        self.inline = inline
        self.started = 0
        self.released = 0
        self.current = READY

    def submit(self, route, requests, alone=False):
        self.routes.append((tuple(route), len(requests)))
        for request in requests:
            self.alone.append(alone)
            WatchedRequest(self, request, alone)

    def table(self) -> ModelTable:
        return self.current


class WatchedRequest:
    """A request queued as ``service/engine/batcher.py`` queues one: this is its owner."""

    def __init__(self, engine: CancelWatchingEngine, request, alone: bool) -> None:
        self.engine = engine
        self.request = request
        self.cancelled = False
        self.delivered = False
        self._held = engine.hold
        request.owner = self
        engine.started += 1
        rows = request.rows
        self._outputs = [np.full((len(rows), 2), rows.sum(), np.float32)]
        if alone and engine.inline:
            self._deliver()
        elif not self._held:
            asyncio.get_running_loop().call_soon(self._deliver)

    def ended(self, request, outputs, error) -> None:
        """Only a cancel ends a request here before it is answered: a held one is answered now."""
        self.cancelled = True
        if self._held:
            self._held = False
            self.engine.released += 1
            self._deliver()

    def _deliver(self) -> None:
        if self.delivered:
            return
        self.delivered = True
        self.engine.gone_at_start.append(self.cancelled)
        request, request.owner = self.request, None
        if request.done:  # cancelled (its rows let go): answered all the same
            request.reply(request, self._outputs, None)
        else:
            request.deliver(0, self._outputs)


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("cancelled", [False, True])
def test_a_call_cancelled_in_the_same_message_never_runs(tmp_path, cancelled, inline):
    """A cancel that travels with its call reaches it before it starts: the call is answered 499
    and never handed to the engine. It used to be handed over and cancelled after, and a lone
    image of an idle model (``inline``) ran before the cancel came (3 of 21 in a fuzz)."""
    engine = CancelWatchingEngine(inline=inline)
    rows = np.zeros((1, 1, 2, 2), np.float32)
    sent: list[bytes] = []

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = hello(server, sent)
        items = [(infer(5, rows), [rows.tobytes()])]
        if cancelled:
            items.append((Cancel(5), []))
        # one message's items, handed over as the server's links hand them
        server.take(link, wire.unpack(memoryview(wire.pack(items)), wire.to_engine))
        await until(lambda: not server._calls)  # started in the next turn, answered after
        await asyncio.sleep(0)  # the answer's flush
        await server.close()

    asyncio.run(scenario())
    answers = [
        item
        for message in sent
        for item, _ in wire.unpack(memoryview(message), wire.to_front_end)
        if not isinstance(item, TableUpdate)
    ]
    if cancelled:
        assert engine.started == 0 and engine.gone_at_start == []
        (refusal,) = answers
        assert refusal.call == 5 and refusal.error.code == "client_disconnected"
        assert refusal.error.status_code == 499
    else:
        assert engine.gone_at_start == [False]
        assert [(type(item), item.call) for item in answers] == [(Answer, 5)]


def test_the_calls_of_a_front_end_that_broke_the_protocol_never_run(tmp_path):
    """A message whose second call reuses the first's id closes its link; the first, arrived in
    the same message, is not handed to the engine either (it used to run, alone and inline)."""
    engine = CancelWatchingEngine(inline=True)
    rows = np.zeros((1, 1, 2, 2), np.float32)
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario():
        server = EngineServer(engine, addresses)
        await server.bind()
        received: list = []
        link = await connect(addresses.engine, received)
        await until(lambda: received)  # its table: said hello
        link.outbox.put(infer(1, rows), rows.data)
        link.outbox.put(infer(1, rows), rows.data)  # the same message, the same id
        await asyncio.wait_for(asyncio.shield(link.closed), 5)
        await until(lambda: not server._calls)
        await server.close()

    asyncio.run(scenario())
    assert engine.started == 0


def test_only_a_call_with_no_other_in_progress_is_run_alone(tmp_path):
    """The engine tells the batcher a call is alone (start it now) only when no other call came with
    it or is still in progress; calls that came together may share a batch."""
    engine = CancelWatchingEngine()
    rows = np.zeros((1, 1, 2, 2), np.float32)

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = hello(server)
        for call_ids in ((1,), (2, 3), (4,)):
            items = [(infer(i, rows), [rows.tobytes()]) for i in call_ids]
            server.take(link, wire.unpack(memoryview(wire.pack(items)), wire.to_engine))
            await until(lambda: not server._calls)  # started and answered
        await server.close()

    asyncio.run(scenario())
    assert engine.alone == [True, False, False, True]


def test_calls_from_two_front_ends_in_one_turn_are_not_alone_and_a_lone_one_is_answered_at_once(
    tmp_path,
):
    """Calls that arrive in one turn of the loop from different front ends may share a batch, so
    neither is alone; no call, answered at once or later, costs a task of its own."""
    engine = CancelWatchingEngine(inline=True)
    rows = np.ones((1, 1, 2, 2), np.float32)
    sent: list[list] = [[], []]

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        links = [hello(server, messages) for messages in sent]
        for call_id, link in enumerate(links, start=1):  # two front ends, one turn
            server.take(link, [(infer(call_id, rows), [rows.tobytes()])])
        await asyncio.sleep(0)
        tasks_for_two = len(server._running)
        await until(lambda: not server._calls)
        await asyncio.sleep(0)  # the answers' flush
        server.take(links[0], [(infer(3, rows), [rows.tobytes()])])
        await asyncio.sleep(0)
        tasks_for_one = len(server._running)
        await server.close()
        return tasks_for_two, tasks_for_one, server._calls

    tasks_for_two, tasks_for_one, calls = asyncio.run(scenario())
    assert engine.alone == [False, False, True]
    assert tasks_for_two == 0 and tasks_for_one == 0 and not calls
    answered = [
        [
            (type(item).__name__, item.call)
            for message in messages
            for item, _ in wire.unpack(memoryview(message), wire.to_front_end)
            if not isinstance(item, TableUpdate)
        ]
        for messages in sent
    ]
    assert answered == [[("Answer", 1), ("Answer", 3)], [("Answer", 2)]]


async def connect(path: str, received: list, arena: str | None = None) -> wire.Link:
    """A front end's connection to the engine server at ``path``, said hello on and recording every
    answer."""
    loop = asyncio.get_running_loop()

    def take(_: wire.Link, items: list) -> None:
        received.extend((item, raw_bytes(raw)) for item, raw in items)

    _, link = await loop.create_unix_connection(lambda: wire.Link(wire.to_front_end, take), path)
    link.outbox.put(Hello(arena))
    return link


def calls_answered(received: list) -> dict[int, tuple]:
    return {item.call: (item, raw) for item, raw in received if not isinstance(item, TableUpdate)}


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
            for call_id in (11, 12):
                rows = np.full((1, 1, 2, 2), call_id + offset * 100, np.float32)
                link.outbox.put(infer(call_id, rows), rows.data)

        await until(lambda: all(len(calls_answered(got)) == 2 for got in answers.values()))
        engine.current = replace(READY, phase="shutting_down", generation=READY.generation + 1)

        def told(got: list) -> bool:
            return any(
                isinstance(item, TableUpdate) and item.table.phase == "shutting_down"
                for item, _ in got
            )

        await until(lambda: all(told(got) for got in answers.values()))
        for link in links.values():
            link.close()
        await server.close()
        return answers

    answers = asyncio.run(scenario())
    for offset, key in enumerate(("a", "b")):
        tables = [item.table for item, _ in answers[key] if isinstance(item, TableUpdate)]
        assert tables and tables[0] == READY
        calls = calls_answered(answers[key])
        assert sorted(calls) == [11, 12]
        for call_id, (answer, raw) in calls.items():
            sum_of_rows = 4 * (call_id + offset * 100)  # what the engine answers for these rows
            assert isinstance(answer, Answer)
            assert np.frombuffer(raw[0], np.float32).tolist() == [sum_of_rows] * 2


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
            link.outbox.put(infer(3, rows), rows.data)
        await until(lambda: engine.started == 2)
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
    arena = Arena(block_name(os.getppid(), 0, os.getpid()), 16 * PAGE)

    def mapped() -> bool:
        return arena.name in Path(f"/proc/{os.getpid()}/maps").read_text()

    async def scenario() -> list[bool]:
        seen = []
        server = EngineServer(engine, addresses)
        await server.bind()
        answers: list = []
        link = await connect(addresses.engine, answers, arena.name)
        rows = np.ones((1, 1, 2, 2), np.float32)
        region = arena.put(rows)
        link.outbox.put(infer(1, rows, region.offset))  # the rows in the block, not the message
        await until(lambda: calls_answered(answers))
        arena.close()  # unlinked, and unmapped here: only the engine's mapping is left
        seen.append(mapped())
        link.transport.abort()
        await until(lambda: not mapped())
        seen.append(mapped())
        await server.close()
        return seen, answers

    seen, answers = asyncio.run(scenario())
    assert seen == [True, False]
    answer, raw = calls_answered(answers)[1]
    assert isinstance(answer, Answer) and np.frombuffer(raw[0], np.float32).tolist() == [4.0] * 2


def test_the_calls_of_one_turn_are_handed_to_the_engine_once_per_route(tmp_path):
    """Calls that arrive in one turn for one model, version and graph reach the engine as one group
    (the version resolved once, the queue looked at once); another version or graph is a group of
    its own; each call is answered its own rows' outputs."""
    engine = CancelWatchingEngine()
    sent: list = []

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = hello(server, sent)
        calls = [
            infer(1, ROWS),
            infer(2, ROWS * 2),
            Infer(3, "m", 2, 2, 7, "classifier", ROWS.shape, ROWS.dtype.str, None),
            infer(4, ROWS * 3),
            Infer(5, "m", 1, None, 7, "attention", ROWS.shape, ROWS.dtype.str, None),
        ]
        rows = [ROWS, ROWS * 2, ROWS, ROWS * 3, ROWS]
        items = [(call, [r.tobytes()]) for call, r in zip(calls, rows, strict=True)]
        server.take(link, wire.unpack(memoryview(wire.pack(items)), wire.to_engine))
        await until(lambda: not server._calls)
        await asyncio.sleep(0)  # the answers' flush
        await server.close()

    asyncio.run(scenario())
    assert engine.routes == [
        (("m", 1, None, 7, "classifier"), 3),
        (("m", 2, 2, 7, "classifier"), 1),
        (("m", 1, None, 7, "attention"), 1),
    ]
    answers = {
        item.call: np.frombuffer(raw[0], np.float32)[0]
        for message in sent
        for item, raw in wire.unpack(memoryview(message), wire.to_front_end)
        if isinstance(item, Answer)
    }
    assert answers == {1: 6.0, 2: 12.0, 3: 6.0, 4: 18.0, 5: 6.0}  # each its own rows' sum


def test_an_engine_fault_on_one_route_fails_only_its_calls(tmp_path):
    """An engine that raises while taking one route's calls: those calls are answered 500 at once,
    the calls of the other routes in the same turn are answered their outputs."""

    class Faulty(CancelWatchingEngine):
        def submit(self, route, requests, alone=False):
            if route.graph == "attention":
                raise RuntimeError("a bug")
            super().submit(route, requests, alone)

    engine, sent = Faulty(), []

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        link = hello(server, sent)
        attention = Infer(2, "m", 1, None, 7, "attention", ROWS.shape, "<f4", None)
        items = [(infer(1, ROWS), [ROWS.tobytes()]), (attention, [ROWS.tobytes()])]
        server.take(link, wire.unpack(memoryview(wire.pack(items)), wire.to_engine))
        async with asyncio.timeout(5):
            while server._calls:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0)  # the answers' flush
        await server.close()

    asyncio.run(scenario())
    answered = {
        item.call: item
        for message in sent
        for item, _ in wire.unpack(memoryview(message), wire.to_front_end)
        if not isinstance(item, TableUpdate)
    }
    assert isinstance(answered[1], Answer)
    assert answered[2].error.status_code == 500 and answered[2].error.code == "inference_failed"


def test_an_item_that_cannot_be_encoded_is_refused_alone_and_the_others_still_go():
    """A version beyond msgpack's 64 bits in one call made the whole message fail to encode: every
    item packed with it was dropped, and its caller waited for ever. Now it is handed to
    ``unsendable`` on its own (which answers its caller), and the other items go."""
    sent: list[bytes] = []
    refused: list = []
    unsendable_call = protocol.Remote(2, "promote", "m", 10**23)

    def unsendable(message, error):
        refused.append((message, type(error)))

    async def scenario():
        outbox = wire.Outbox(sent.append, unsendable)
        outbox.put(Cancel(1))
        outbox.put(unsendable_call)
        outbox.put(Failed("m", 1, 5), b"raw")
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert refused == [(unsendable_call, OverflowError)]
    assert [unpacked(message) for message in sent] == [
        [(Cancel(1), []), (Failed("m", 1, 5), [b"raw"])]
    ]


def test_each_control_operation_is_called_with_the_arguments_its_row_names():
    """One table (service/contract/control.py) says what each operation takes: the Remote message
    hands Engine.control those arguments and no others, and the link knows no other operation."""
    expected = {
        "index": {},
        "metrics": {},
        "load": {"name": "m"},
        "unload": {"name": "m"},
        "shadow": {"name": "m"},
        "rollback": {"name": "m"},
        "config": {"name": "m", "version": 3},
        "statistics": {"name": "m", "version": 3},
        "promote": {"name": "m", "version": 3},
    }
    assert get_args(ControlOp) == tuple(OPERATIONS) and set(OPERATIONS) == set(expected)
    for op, arguments in expected.items():
        assert protocol.Remote(1, op, "m", 3).arguments() == arguments, op
    unknown = wire.encoder.encode([(protocol.Remote(1, "index"), [])]).replace(b"index", b"erase")
    with pytest.raises(protocol.msgspec.ValidationError, match="Invalid enum value 'erase'"):
        wire.to_engine.decode(unknown)
