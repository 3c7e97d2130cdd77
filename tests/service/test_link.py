"""The process link's messages: what one turn of the event loop has ready goes as one ZeroMQ message,
items come out in order with their raw frames, and a cancel that travels with its call still cancels it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from service.engine.table import ModelTable
from service.link import wire
from service.link.engine_server import EngineServer
from service.link.remote import RemoteEngine
from service.observability.metrics import Metrics


class Frame:
    """What ZeroMQ hands a receiver (copy=False): the bytes, and a buffer over them."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def received(frames: list) -> list[Frame]:
    return [Frame(bytes(frame)) for frame in frames]


def test_items_come_out_in_order_with_their_own_raw_frames():
    items = [
        ((wire.INFER, (1, "m")), [b"rows-1"]),
        ((wire.CANCEL, 7), []),
        ((wire.INFER, (2, "m")), [b"rows-2a", b"rows-2b"]),
        ((wire.FAILED, ("m", 1, 5)), []),
    ]
    frames = wire.pack(items)
    assert len(frames) == 1 + 3  # the headers, then the four raw frames
    out = [(header, [f.bytes for f in raw]) for header, raw in wire.unpack(received(frames))]
    assert out == items


def test_what_one_loop_turn_puts_goes_as_one_message():
    sent: list[list] = []

    def send(frames: list) -> asyncio.Future:
        sent.append(frames)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def scenario():
        outbox = wire.Outbox(send, prefix=(b"peer",))
        outbox.put(("a", 1), b"x")
        outbox.put(("b", 2))
        outbox.put(("c", 3), b"y", b"z")
        assert sent == []  # nothing leaves before the loop has run what was ready
        await asyncio.sleep(0)
        outbox.put(("d", 4))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(sent) == 2
    first, second = sent
    assert first[0] == b"peer" and second[0] == b"peer"
    assert [h for h, _ in wire.unpack(received(first[1:]))] == [("a", 1), ("b", 2), ("c", 3)]
    assert [r for _, r in wire.unpack(received(first[1:]))][2][1].bytes == b"z"
    assert [h for h, _ in wire.unpack(received(second[1:]))] == [("d", 4)]


def test_a_lone_item_goes_at_once_and_never_ahead_of_one_already_waiting():
    sent: list[list] = []

    async def scenario():
        outbox = wire.Outbox(sent.append)
        outbox.put(("lone", 1), b"x", at_once=True)
        assert len(sent) == 1  # not held for the loop's next turn
        outbox.put(("a", 2))
        outbox.put(("b", 3), at_once=True)  # behind "a": waits with it, order kept
        assert len(sent) == 1
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [[h for h, _ in wire.unpack(received(message))] for message in sent] == [
        [("lone", 1)],
        [("a", 2), ("b", 3)],
    ]
    assert next(wire.unpack(received(sent[0])))[1][0].bytes == b"x"


def infer_header(call_id: int, rows: np.ndarray) -> tuple:
    """An INFER header (service/link/remote.py's order) for rows sent inline."""
    return (call_id, "m", 1, None, ("k",), "classifier", None, None, 0, rows.shape, rows.dtype.str,
            None)  # fmt: skip


class CancelWatchingEngine:
    """An engine whose infer reports whether the client-gone signal had completed when it ran."""

    def __init__(self) -> None:
        self.gone_at_start: list[bool] = []

    async def infer(self, name, version, requested, key, graph, rows, request_id, gone):
        self.gone_at_start.append(gone.done())
        return [(np.zeros(1, np.float32),) for _ in rows]

    def table(self) -> ModelTable:
        return ModelTable(phase="starting", retry_after_s=1)


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_cancel_in_the_same_message_as_its_call_reaches_it(tmp_path, cancelled):
    engine = CancelWatchingEngine()
    rows = np.zeros((1, 1, 2, 2), np.float32)

    async def scenario():
        server = EngineServer(engine, wire.Addresses.in_directory(str(tmp_path)))
        server.bind()
        header = infer_header(5, rows)
        items = [((wire.INFER, header), [rows.tobytes()])]
        if cancelled:
            items.append(((wire.CANCEL, 5), []))
        for (kind, item), raw in wire.unpack(received(wire.pack(items))):
            server._take(b"front-end", kind, item, raw)
        await asyncio.gather(*server._running)
        await server.close()

    asyncio.run(scenario())
    assert engine.gone_at_start == [cancelled]


def test_answers_reach_the_front_end_that_asked(tmp_path):
    """Over real ZeroMQ sockets: two calls in one message, two answers back, each to its caller."""
    engine = CancelWatchingEngine()
    rows = np.zeros((1, 1, 2, 2), np.float32)

    async def scenario():
        addresses = wire.Addresses.in_directory(str(tmp_path))
        server = EngineServer(engine, addresses)
        server.bind()
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(addresses.calls)
        items = [
            ((wire.INFER, infer_header(call_id, rows)), [rows.tobytes()]) for call_id in (11, 12)
        ]
        await dealer.send_multipart(wire.pack(items))
        answers = []
        while len(answers) < 2:
            async with asyncio.timeout(10):
                frames = await dealer.recv_multipart(copy=False)
            answers.extend(wire.unpack(frames))
        context.destroy(linger=0)
        await server.close()
        return answers

    answers = asyncio.run(scenario())
    assert sorted(call_id for (call_id, ok, _), _ in answers) == [11, 12]
    assert all(ok for (_, ok, _), _ in answers)


def _loop_pair(context: zmq.Context, address: str, on_echoed, *, fail_on: bytes | None = None):
    """A ROUTER that echoes each message (through a LoopSocket) and a DEALER LoopSocket."""
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    echo: list[wire.LoopSocket] = []

    def bounce(frames: list) -> None:
        if frames[-1].bytes == fail_on:
            raise ValueError("a message its handler cannot take")
        asyncio.get_running_loop().call_soon(echo[0].send, frames)  # as an Outbox sends

    echo.append(wire.LoopSocket(router, bounce))
    dealer = context.socket(zmq.DEALER)
    dealer.connect(address)
    return echo[0], wire.LoopSocket(dealer, on_echoed)


def test_loop_sockets_deliver_every_message_however_sends_and_arrivals_interleave(tmp_path):
    """ZeroMQ's descriptor is edge-triggered: a message that arrives while this side sends must
    still be seen without waiting for the next one (a lost edge hangs the round trips below)."""
    received: list[bytes] = []

    async def scenario():
        context = zmq.Context()
        done = asyncio.get_running_loop().create_future()

        def echoed(frames: list) -> None:
            received.append(frames[-1].bytes)
            if len(received) < 2000:
                # the next trip, sent after the handler as an Outbox sends
                asyncio.get_running_loop().call_soon(dealer.send, [b"%d" % len(received)])
            elif not done.done():
                done.set_result(None)

        router, dealer = _loop_pair(context, f"ipc://{tmp_path}/pair", echoed)
        for n in range(50):  # a burst besides the chain of single round trips
            dealer.send([b"burst-%d" % n])
        dealer.send([b"0"])
        async with asyncio.timeout(10):
            await done
        router.close()
        dealer.close()
        context.destroy(linger=0)

    asyncio.run(scenario())
    assert [m for m in received if m.startswith(b"burst-")] == [b"burst-%d" % n for n in range(50)]
    assert len(received) >= 2000


def test_a_message_its_handler_refuses_does_not_stop_the_link(tmp_path, caplog):
    received: list[bytes] = []

    async def scenario():
        context = zmq.Context()
        router, dealer = _loop_pair(
            context,
            f"ipc://{tmp_path}/pair",
            lambda f: received.append(f[-1].bytes),
            fail_on=b"bad",
        )
        for body in (b"one", b"bad", b"two"):
            dealer.send([body])
        async with asyncio.timeout(10):
            while len(received) < 2:
                await asyncio.sleep(0.005)
        router.close()
        dealer.close()
        context.destroy(linger=0)

    asyncio.run(scenario())
    assert received == [b"one", b"two"]
    assert "could not be handled" in caplog.text


def test_a_long_queue_is_handed_over_in_turns_of_the_loop(tmp_path, monkeypatch):
    """More than DRAIN_BATCH waiting messages all arrive, and the loop runs other work between
    batches instead of reading them all in one callback."""
    monkeypatch.setattr(wire.LoopSocket, "DRAIN_BATCH", 8)
    order: list[str] = []

    async def scenario():
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp_path}/queue")
        push = context.socket(zmq.PUSH)
        push.connect(f"ipc://{tmp_path}/queue")
        for n in range(40):
            push.send(b"%d" % n)
        while pull.poll(0) == 0:  # all 40 have reached the receiving socket
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        socket = wire.LoopSocket(pull, lambda f: order.append(f[-1].bytes.decode()))
        loop.call_soon(lambda: loop.call_soon(lambda: order.append("other work")))
        async with asyncio.timeout(10):
            while len(order) < 41:
                await asyncio.sleep(0.001)
        socket.close()
        push.close(linger=0)
        context.destroy(linger=0)

    asyncio.run(scenario())
    messages = [m for m in order if m != "other work"]
    assert messages == [str(n) for n in range(40)]
    assert 0 < order.index("other work") < 40


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
        async with asyncio.timeout(10):
            while remote.connected:  # its death, seen through its pidfd
                await asyncio.sleep(0.01)
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


def io_thread_policies(make_context) -> list[int]:
    """The scheduling policy of each I/O thread of the context ``make_context()`` returns."""

    def threads() -> dict[int, str]:
        names = {}
        for task in Path("/proc/self/task").iterdir():
            # a thread may end meanwhile (the policy's probe)
            with contextlib.suppress(FileNotFoundError):
                names[int(task.name)] = (task / "comm").read_text().strip()
        return names

    before = threads()
    context = make_context()
    socket = context.socket(zmq.DEALER)  # the context's threads start with its first socket
    try:
        deadline = time.monotonic() + 5
        while True:  # each names itself once running
            io = [tid for tid, name in threads().items() if tid not in before and "IO" in name]
            if io or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return [os.sched_getscheduler(tid) for tid in io]
    finally:
        socket.close(0)
        context.term()


def test_the_link_s_io_thread_never_preempts_the_event_loop_that_wakes_it():
    """ZeroMQ's I/O thread, woken by every send, runs SCHED_BATCH: on a loaded machine a woken
    thread of the normal policy takes the core from the loop that woke it mid-turn."""
    assert io_thread_policies(wire.context) == [os.SCHED_BATCH]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is untouched


def test_where_the_policy_is_refused_the_link_keeps_the_normal_one(monkeypatch):
    """libzmq aborts the process when it cannot set its threads' policy (a sandbox may refuse it):
    the context asks only where a thread of this process was allowed to take it."""

    def refused(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    wire._may_batch.cache_clear()
    try:
        assert io_thread_policies(wire.context) == [os.SCHED_OTHER]
    finally:
        monkeypatch.undo()
        wire._may_batch.cache_clear()
