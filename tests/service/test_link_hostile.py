"""The engine's socket against a same-user process that does not play by the protocol: nothing it sends is
unpickled or run, a size it claims is not allocated, a name it gives is not taken for a path, and a message
of its that breaks the protocol closes its own link only; a call of its that is merely wrong (rows that are
not where it says, an unknown model) is refused on its own. The honest front ends' calls, in the same turn
of the engine's loop, are answered all the same."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from service.engine.server import EngineServer
from service.errors import NotFound
from service.link import wire
from service.link.arena import PAGE, SHM, Arena, block_name
from service.link.protocol import Answer, Cancel, Hello, Infer, Refusal, TableUpdate
from tests.service.test_link import CancelWatchingEngine, calls_answered, connect, infer, until

ROWS = np.ones((1, 1, 2, 2), np.float32)  # the fake engine answers their sum, 4.0, twice


class StrictEngine(CancelWatchingEngine):
    """Serves model "m" only, as the engine does: any other name is a 404."""

    def submit(self, route, requests, alone=False):
        if route.name != "m":
            for request in requests:
                request.fail(NotFound(f"unknown model '{route.name}'", field="model"))
            return
        super().submit(route, requests, alone)


def framed(items: bytes, raw: bytes = b"", claimed: int | None = None) -> bytes:
    """A message as the link frames it: two lengths, the items, the raw frames."""
    lengths = (len(items), len(raw)) if claimed is None else (claimed, 0)
    return struct.pack("<QQ", *lengths) + items + raw


async def closed_by_engine(reader: asyncio.StreamReader, seconds: float = 5) -> bool:
    """The engine closed the connection (whatever it had sent before)."""
    async with asyncio.timeout(seconds):
        while await reader.read(1 << 16):
            pass
    return True


def answered_honestly(received: list, call_id: int) -> bool:
    answer, raw = calls_answered(received).get(call_id, (None, None))
    return isinstance(answer, Answer) and np.frombuffer(raw[0], np.float32).tolist() == [4.0] * 2


class Evil:
    """Unpickling it runs a command (what ``pickle.loads`` on the engine's socket did)."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


def hostile_messages(witness: Path) -> dict[str, bytes]:
    evil = pickle.dumps([((b"I", Evil(witness)), [])])
    return {
        "pickle": framed(evil),
        "2^40 bytes": framed(b"", claimed=2**40),
        "wrong arity": framed(wire.encoder.encode([(["infer", 1, "m"], [])])),
        "unknown kind": framed(wire.encoder.encode([(["shell", "id"], [])])),
        "frames that do not add up": framed(
            wire.encoder.encode([(infer(1, ROWS), [16])]), b"\0" * 8
        ),
        # a raw section longer than its frames: bytes no item claims (a '>' for the '!=' missed it)
        "a raw section longer than its frames": framed(
            wire.encoder.encode([(infer(1, ROWS), [16])]), b"\0" * 24
        ),
        "call before hello": framed(wire.encoder.encode([(infer(1, ROWS), [16])]), b"\0" * 16),
    }


@pytest.mark.parametrize("kind", list(hostile_messages(Path("x"))))
def test_a_hostile_message_closes_its_sender_s_link_and_sixteen_honest_calls_are_answered(
    tmp_path, kind
):
    """Sixteen honest front ends send a call each in the same turn as the hostile one's message:
    every honest call is answered, the hostile link is closed at once (a message claiming 2^40
    bytes is not waited for), and nothing it sent ran (a pickle that would ``touch`` a file)."""
    witness = tmp_path / "pwned"
    message = hostile_messages(witness)[kind]
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario() -> tuple[list[list], bool, int]:
        server = EngineServer(StrictEngine(), addresses)
        await server.bind()
        received: list[list] = [[] for _ in range(16)]
        links = [await connect(addresses.engine, got) for got in received]
        await until(lambda: all(got for got in received))  # each has its table: connected
        reader, writer = await asyncio.open_unix_connection(addresses.engine)
        if kind not in ("pickle", "call before hello"):
            writer.write(wire.pack([(Hello(None), [])]))
            await writer.drain()
            await until(lambda: len(server._links) == 17)
        for call_id, link in enumerate(links, start=1):  # one turn: the hostile message among them
            link.outbox.put(infer(call_id, ROWS), ROWS.data, at_once=True)
            if call_id == 8:
                writer.write(message)
        closed = await closed_by_engine(reader)
        await until(lambda: all(calls_answered(got) for got in received))
        writer.close()
        for link in links:
            link.close()
        await server.close()
        return received, closed

    received, closed = asyncio.run(scenario())
    assert closed
    assert all(answered_honestly(got, call_id) for call_id, got in enumerate(received, start=1))
    assert not witness.exists()


def test_a_duplicate_call_id_closes_its_sender_and_cancels_its_calls(tmp_path):
    """A second call under an id still in progress is a broken front end: its link is closed and
    its calls cancelled (their rows never run); another front end's call with the same id is its
    own and is answered."""
    engine = StrictEngine(hold=True)
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario() -> tuple[list, list, bool]:
        server = EngineServer(engine, addresses)
        await server.bind()
        honest, broken = [], []
        good = await connect(addresses.engine, honest)
        bad = await connect(addresses.engine, broken)
        await until(lambda: honest and broken)
        good.outbox.put(infer(5, ROWS), ROWS.data)
        bad.outbox.put(infer(5, ROWS), ROWS.data)
        await until(lambda: engine.started == 2)
        bad.outbox.put(infer(5, ROWS), ROWS.data)  # 5 is still in progress
        await asyncio.wait_for(asyncio.shield(bad.closed), 5)
        await until(lambda: engine.released == 1)  # its held call was cancelled
        good.outbox.put(Cancel(5))
        await until(lambda: calls_answered(honest))
        good.close()
        await server.close()
        return honest, broken, bad.closed.done()

    honest, broken, closed = asyncio.run(scenario())
    assert closed and not calls_answered(broken)
    assert answered_honestly(honest, 5)


def test_an_arena_named_by_a_path_or_for_another_process_is_never_mapped(tmp_path):
    """The engine maps only the block this front end's process would own (its name carries the
    supervisor's pid and the pid the kernel gives for the other end of the socket): a path to a
    system file, the block of another process, or a link in /dev/shm closes the link unmapped."""
    addresses = wire.Addresses.in_directory(str(tmp_path))
    other = Arena(block_name(os.getppid(), 1, os.getpid() + 1), 4 * PAGE)  # not this process's
    link_name = block_name(os.getppid(), 2, os.getpid())
    os.symlink("/etc/ld.so.cache", os.path.join(SHM, link_name))
    names = ["../../../etc/ld.so.cache", "/etc/ld.so.cache", other.name, link_name]

    def mapped(server: EngineServer) -> bool:
        return bool(server._reader._blocks) or "ld.so.cache" in Path("/proc/self/maps").read_text()

    async def scenario() -> list[tuple[bool, bool]]:
        server = EngineServer(StrictEngine(), addresses)
        await server.bind()
        seen = []
        for name in names:
            got: list = []
            link = await connect(addresses.engine, got, name)
            await asyncio.wait_for(asyncio.shield(link.closed), 5)
            seen.append((link.closed.done() and not got, mapped(server)))
        await server.close()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        other.close()
        os.unlink(os.path.join(SHM, link_name))
    assert seen == [(True, False)] * len(names)


def test_a_call_that_is_merely_wrong_is_refused_alone_and_its_link_goes_on(tmp_path):
    """Rows said to lie past the arena's end, an inline frame that does not hold its shape, rows
    of another dtype, an unknown model: each is answered 4xx on its own; the next call on the same
    link is answered."""
    addresses = wire.Addresses.in_directory(str(tmp_path))
    arena = Arena(block_name(os.getppid(), 0, os.getpid()), 4 * PAGE)

    def wrong(call_id: int) -> tuple[Infer, list]:
        base = infer(call_id, ROWS)
        return [
            (Infer(**{**_fields(base), "offset": 3 * PAGE, "shape": (1024, 1, 2, 2)}), []),
            (Infer(**{**_fields(base), "shape": (2, 1, 2, 2)}), [ROWS.data]),
            (Infer(**{**_fields(base), "dtype": "<f8"}), [ROWS.data]),
            (Infer(**{**_fields(base), "dtype": "|O"}), [ROWS.data]),
            (Infer(**{**_fields(base), "name": "nope"}), [ROWS.data]),
        ][call_id - 1]

    async def scenario() -> list:
        server = EngineServer(StrictEngine(), addresses)
        await server.bind()
        got: list = []
        link = await connect(addresses.engine, got, arena.name)
        for call_id in range(1, 6):
            message, raw = wrong(call_id)
            link.outbox.put(message, *raw)
        link.outbox.put(infer(6, ROWS), ROWS.data)
        await until(lambda: len(calls_answered(got)) == 6)
        open_after = link.open
        link.close()
        await server.close()
        return got, open_after

    try:
        got, open_after = asyncio.run(scenario())
    finally:
        arena.close()
    answers = calls_answered(got)
    statuses = [answers[i][0].error.status_code for i in range(1, 6)]
    assert all(isinstance(answers[i][0], Refusal) for i in range(1, 6))
    assert statuses == [400, 400, 400, 400, 404]
    assert open_after and answered_honestly(got, 6)
    assert not [item for item, _ in got if not isinstance(item, TableUpdate | Answer | Refusal)]


def _fields(message: Infer) -> dict:
    return {name: getattr(message, name) for name in message.__struct_fields__}


class Answers(StrictEngine):
    """Answers every call at once with ``width`` float32 a row: sizeable answers for few bytes of
    call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def submit(self, route, requests, alone=False):
        for request in requests:
            self.started += 1
            request.deliver(0, [np.zeros((len(request.rows), self.width), np.float32)])


CALLS = 4 * 2000  # the report: 4 x 2,000 calls whose answers were never read


def bound_unread_answers(monkeypatch, max_bytes: int) -> None:
    """The engine stops reading a link's calls past 64 KiB of answers unsent, and closes the link
    past ``max_bytes``."""
    monkeypatch.setattr(wire, "UNREAD_PAUSE_BYTES", 64 * 1024, raising=False)
    monkeypatch.setattr(wire, "UNREAD_MAX_BYTES", max_bytes, raising=False)


async def unread_calls(engine: Answers, addresses: wire.Addresses) -> tuple:
    """``engine``'s server, bound, and a same-user client that says hello and sends ``CALLS``
    calls without reading a byte of what comes back; returns the server, the client's reader and
    writer, and the engine's end of its link."""
    server = EngineServer(engine, addresses)
    await server.bind()
    reader, writer = await asyncio.open_unix_connection(addresses.engine)
    writer.write(wire.pack([(Hello(None), [])]))
    await until(lambda: len(server._links) == 1)
    (link,) = server._links
    for first in range(1, CALLS + 1, 100):  # asyncio keeps what the socket does not take
        writer.write(wire.pack([(infer(i, ROWS), [ROWS.data]) for i in range(first, first + 100)]))
    return server, reader, writer, link


def test_a_front_end_that_never_reads_is_not_sent_more_than_the_bound(tmp_path, monkeypatch):
    """A client that never reads its answers held the engine's memory (234 -> 348 MiB for 4 x 2,000
    calls) until it disconnected. Past UNREAD_PAUSE_BYTES unsent, the engine stops reading its
    calls: it holds what one read brought at most, and every call is answered once the client
    reads."""
    bound_unread_answers(monkeypatch, max_bytes=64 * 2**20)  # not reached
    engine = Answers(width=512)  # 2 KiB an answer: 16 MiB for every call
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario():
        server, reader, writer, link = await unread_calls(engine, addresses)
        # settled: it stopped reading (or, unbounded, read every call), and answered what it read
        await until(
            lambda: (
                (getattr(link, "reading_paused", False) or engine.started == CALLS)
                and not server._calls
                and not server._arrived
            )
        )
        held, started = link.transport.get_write_buffer_size(), engine.started
        answered: list = []
        client = wire.Link(wire.to_front_end, lambda _, items: answered.extend(items))
        while len([a for a, _ in answered if isinstance(a, Answer)]) < CALLS:
            client.data_received(await reader.read(1 << 20))
        writer.close()
        await server.close()
        return held, started, {a.call for a, _ in answered if isinstance(a, Answer)}

    held, started, answered = asyncio.run(scenario())
    # one read of calls (asyncio reads 256 KiB: about 2,600 calls, 5 MiB of answers) past the mark
    assert held <= 64 * 1024 + 256 * 1024 // 90 * 2100, held
    assert started < CALLS, started  # it stopped reading: the rest waited in the client
    assert answered == set(range(1, CALLS + 1))  # and it read again once the answers drained


def test_a_front_end_whose_unread_answers_pass_the_limit_is_closed(tmp_path, monkeypatch):
    """Answers so large that one read of calls passes UNREAD_MAX_BYTES: the link is closed and its
    calls let go, rather than held for a client that does not read."""
    bound_unread_answers(monkeypatch, max_bytes=2**20)
    engine = Answers(width=4096)  # 16 KiB an answer: 128 MiB for every call
    addresses = wire.Addresses.in_directory(str(tmp_path))

    async def scenario():
        server, _, writer, link = await unread_calls(engine, addresses)
        await until(lambda: link.closed.done() or engine.started == CALLS, 30)
        await until(lambda: link.closed.done() or not server._calls, 30)
        closed = link.closed.done()
        honest: list = []
        other = await connect(addresses.engine, honest)
        other.outbox.put(infer(1, ROWS), ROWS.data)
        await until(lambda: calls_answered(honest))
        other.close()
        writer.close()
        await server.close()
        return closed, server._calls, engine.started

    closed, calls, started = asyncio.run(scenario())
    assert closed and not calls
    assert started < CALLS, started
