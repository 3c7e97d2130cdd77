"""service/engine/request.py: the engine's one request object, ended once and always the same way.

A client that goes away ends the request with ClientGone at once (not at its deadline); a caller that is
cancelled ends the request, so that its queued images are abandoned rather than run; a request answered
before it is awaited lets its client-gone signal go. Through a batcher, every end (outputs, timeout,
client gone, refusal) reaches the request's reply once, with the statistics counted once.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.engine.request import ClientGone, Request, TimedOut, awaited
from service.errors import ServiceUnavailable
from tests.service.test_batcher import Model, batcher, rows, run


def replies() -> tuple[list, object]:
    got: list = []
    return got, lambda request, outputs, error: got.append((outputs, error))


def test_a_client_that_goes_away_is_answered_client_gone_before_the_deadline():
    async def scenario() -> tuple[BaseException, bool, float]:
        loop = asyncio.get_running_loop()
        left = loop.create_future()
        loop.call_later(0.05, left.set_result, None)
        started: list[Request] = []
        start = loop.time()
        with pytest.raises(ClientGone) as error:
            # nothing runs it and no deadline is set: only the client's going away ends it
            await asyncio.wait_for(awaited(started.append, rows(1, 2), None, left), 10)
        return error.value, started[0].done, loop.time() - start

    error, done, waited = asyncio.run(scenario())
    assert isinstance(error, ClientGone) and done and waited < 5


def test_a_request_joins_its_parts_in_order_and_ends_once():
    got, reply = replies()
    request = Request(rows(0, 1), reply)
    request.deliver(1, [np.ones((1, 3))])  # image 1 of 2, one output
    assert not request.done and not got
    request.deliver(0, [np.zeros((1, 3))])
    request.fail(TimedOut())  # ended already: nothing
    request.deliver(0, [np.zeros((1, 3))])
    ((outputs, error),) = got
    assert error is None and outputs[0].tolist() == [[0.0] * 3, [1.0] * 3]


def test_a_cancelled_caller_ends_the_request():
    async def scenario() -> tuple[bool, list]:
        loop = asyncio.get_running_loop()
        started: list[Request] = []
        waiter = asyncio.ensure_future(awaited(started.append, rows(1), None, loop.create_future()))
        await asyncio.sleep(0.01)
        assert not started[0].done
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        request = started[0]
        request.deliver(0, [np.zeros((1, 3))])  # its batch ran after all: nobody is answered twice
        return request.done, request.parts

    assert asyncio.run(scenario()) == (True, [])


def test_a_request_answered_before_it_waits_lets_its_client_gone_signal_go():
    """A lone image run inline is answered before its caller waits: the wait returns its outputs at
    once, and the client-gone signal it was given is cancelled (a future) or closed (a coroutine,
    never left un-awaited)."""

    async def never() -> None:
        await asyncio.Event().wait()

    def answer(request: Request) -> None:
        request.deliver(0, [np.full((1, 2), 7.0)])

    async def scenario() -> tuple[list, bool, bool]:
        loop = asyncio.get_running_loop()
        signal = loop.create_future()
        outputs = await awaited(answer, rows(1), None, signal)
        coroutine = never()
        await awaited(answer, rows(1), None, coroutine)
        return outputs, signal.cancelled(), coroutine.cr_frame is None

    outputs, cancelled, closed = asyncio.run(scenario())
    assert outputs[0].tolist() == [[7.0, 7.0]] and cancelled and closed


def test_every_end_through_a_batcher_reaches_the_reply_once():
    """Ran, timed out, client gone, refused: each request's reply gets its outcome once (its own
    rows' outputs, a 503 timeout at its deadline, a 499 when its client went away, whose rows then
    never run, a 503 queue_full), and the statistics count each request once."""
    model = Model()

    async def scenario() -> tuple[dict[str, list], dict]:
        b = batcher(model, timeout_s=0.2, max_queue_delay_s=0.0, max_queue_size=2)
        b.start()
        handed: dict[str, list] = {"ran": [], "late": [], "gone": [], "refused": []}

        def to(name: str, values: np.ndarray) -> Request:
            return Request(values, lambda r, outputs, error: handed[name].append((outputs, error)))

        b.enqueue([to("ran", rows(1, 2))])
        await until_handed(handed["ran"])
        model.gate.clear()  # the next batch holds its instance past the deadline
        b.enqueue([to("late", rows(3))])
        await until_handed(handed["late"], 5)
        gone = to("gone", rows(4))  # queued behind the held batch
        b.enqueue([gone, to("refused", rows(5, 6))])  # the queue holds 2: one image is queued
        gone.cancel()
        gone.cancel()
        await asyncio.sleep(0.05)
        model.gate.set()
        await b.stop(5)
        return handed, b.statistics.as_dict("m", "1")["inference_stats"]

    handed, stats = run(scenario())
    ((outputs, error),) = handed["ran"]
    assert error is None and outputs[0].tolist() == [1.0, 2.0]
    ((outputs, error),) = handed["late"]
    assert outputs is None and isinstance(error, ServiceUnavailable) and error.code == "timeout"
    ((outputs, error),) = handed["gone"]
    assert outputs is None and error.status_code == 499
    ((outputs, error),) = handed["refused"]
    assert outputs is None and error.code == "queue_full"
    assert model.batches == [2, 1]  # the gone request's row never ran
    assert stats["success"]["count"] == 1 and stats["fail"]["count"] == 3


async def until_handed(handed: list, seconds: float = 5) -> None:
    async with asyncio.timeout(seconds):
        while not handed:
            await asyncio.sleep(0.005)


def test_requests_queued_at_different_times_each_time_out_at_their_own_deadline():
    """One timer serves every deadline of a batcher: each request queued behind a held batch is
    answered 503 once its own timeout has passed since it was queued, in the order they came."""
    model = Model()

    async def scenario() -> list[tuple[str, float, str]]:
        loop = asyncio.get_running_loop()
        b = batcher(model, timeout_s=0.2, max_queue_delay_s=0.0)
        b.start()
        model.gate.clear()  # the first batch holds the instance past every deadline
        ended: list[tuple[str, float, str]] = []
        queued: dict[str, float] = {}

        def enqueue(name: str) -> None:
            queued[name] = loop.time()

            def reply(request: Request, outputs: object, error: Exception) -> None:
                ended.append((name, loop.time(), getattr(error, "code", None)))

            b.enqueue([Request(rows(1), reply)])

        for name in ("held", "first", "second", "third"):
            enqueue(name)
            await asyncio.sleep(0.07)
        async with asyncio.timeout(5):
            while len(ended) < 4:
                await asyncio.sleep(0.01)
        model.gate.set()
        await b.stop(5)
        return [(name, at - queued[name], code) for name, at, code in ended]

    ended = run(scenario())
    assert [name for name, _, _ in ended] == ["held", "first", "second", "third"]
    assert all(code == "timeout" for _, _, code in ended)
    assert all(waited >= 0.2 for _, waited, _ in ended), ended  # never before its own deadline
