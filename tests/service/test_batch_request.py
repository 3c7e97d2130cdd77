"""service/engine/batch_request.py: one caller's request in the batcher's queue, answered once.

Written against `make mutation`'s survivors in ``BatchRequest.wait``: a client that goes away answers
the request with ClientGone at once (not at its deadline), and a caller that is cancelled leaves the
request answered, so that its queued images are abandoned rather than run. A request handed over by
``DynamicBatcher.finish`` (a callback, not awaited) ends as an awaited one does.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.engine.batch_request import BatchRequest, ClientGone, QueueItem, TimedOut
from service.errors import ServiceUnavailable
from tests.service.test_batcher import Model, batcher, rows, run


def item(request: BatchRequest, index: int = 0) -> QueueItem:
    return QueueItem(row=np.zeros(3, np.float32), request=request, index=index)


def test_a_client_that_goes_away_is_answered_client_gone_before_the_deadline():
    async def scenario() -> tuple[BaseException, bool, float]:
        loop = asyncio.get_running_loop()
        request = BatchRequest(loop.create_future(), 2)
        queued = item(request)
        left = loop.create_future()
        loop.call_later(0.05, left.set_result, None)
        start = loop.time()
        with pytest.raises(ClientGone) as error:
            # the deadline is far: only the client's going away can end this in time
            await asyncio.wait_for(request.wait(loop.time() + 30, left), 10)
        return error.value, queued.abandoned, loop.time() - start

    error, abandoned, waited = asyncio.run(scenario())
    assert isinstance(error, ClientGone) and abandoned and waited < 5


def test_the_deadline_answers_timed_out_and_an_answer_in_time_cancels_nothing():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        late = BatchRequest(loop.create_future(), 1)
        with pytest.raises(TimedOut):
            await late.wait(loop.time() + 0.05, None)
        assert item(late).abandoned
        on_time = BatchRequest(loop.create_future(), 2)
        still_connected = loop.create_future()
        loop.call_soon(on_time.deliver, 1, (np.ones((1, 3)),))  # image 1 of 2, one output
        loop.call_soon(on_time.deliver, 0, (np.zeros((1, 3)),))
        outputs = await on_time.wait(loop.time() + 30, still_connected)
        assert outputs[0].tolist() == [[0.0] * 3, [1.0] * 3]  # in the images' order
        # the watch on the client is cancelled: its ending later answers nothing again
        assert still_connected.cancelled()
        assert on_time.future.result() is outputs

    asyncio.run(scenario())


def test_a_cancelled_caller_leaves_its_images_abandoned():
    async def scenario() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        request = BatchRequest(loop.create_future(), 1)
        queued = item(request)
        waiter = asyncio.ensure_future(request.wait(loop.time() + 30, loop.create_future()))
        await asyncio.sleep(0.01)
        assert not queued.abandoned
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        request.deliver(0, (np.zeros((1, 3)),))  # its batch ran after all: nobody is answered twice
        return queued.abandoned, request.future.cancelled()

    assert asyncio.run(scenario()) == (True, True)


def test_a_request_answered_before_it_waits_lets_its_client_gone_signal_go():
    """A lone image run inline is answered before its caller waits: the wait returns its outputs at
    once, and the client-gone signal it was given is cancelled (a future) or closed (a coroutine,
    never left un-awaited)."""

    async def never() -> None:
        await asyncio.Event().wait()

    async def scenario() -> tuple[list, bool, bool]:
        loop = asyncio.get_running_loop()
        answered = BatchRequest(loop.create_future(), 1)
        answered.deliver(0, (np.full((1, 2), 7.0),))
        signal = loop.create_future()
        outputs = await answered.wait(loop.time() + 30, signal)
        coroutine = never()
        await answered.wait(loop.time() + 30, coroutine)
        return outputs, signal.cancelled(), coroutine.cr_frame is None

    outputs, cancelled, closed = asyncio.run(scenario())
    assert outputs[0].tolist() == [[7.0, 7.0]] and cancelled and closed


def test_a_request_handed_over_by_finish_is_answered_timed_out_or_cancelled_like_an_awaited_one():
    """``finish`` (the engine process's way: a callback, no task) ends a request as ``answer``
    does: its own rows' outputs once its batch ran, a 503 timeout at its deadline, a 499 when its
    client went away (its rows then never run); each callback once."""
    model = Model()

    async def scenario() -> dict[str, list]:
        b = batcher(model, timeout_s=0.2, max_queue_delay_s=0.0)
        b.start()
        handed: dict[str, list] = {"ran": [], "late": [], "gone": []}

        def to(name: str):
            return lambda outputs, error: handed[name].append((outputs, error))

        b.finish(b.enqueue(rows(1, 2)), to("ran"))
        await until_handed(handed["ran"])
        model.gate.clear()  # the next batch holds its instance past the deadline
        b.finish(b.enqueue(rows(3)), to("late"))
        await until_handed(handed["late"], 5)
        gone = b.enqueue(rows(4))  # queued behind the held batch
        b.finish(gone, to("gone"))
        gone.fail(ClientGone())
        await asyncio.sleep(0.05)
        model.gate.set()
        await b.stop(5)
        return handed

    handed = run(scenario())
    ((outputs, error),) = handed["ran"]
    assert error is None and outputs[0].tolist() == [1.0, 2.0]
    ((outputs, error),) = handed["late"]
    assert outputs is None and isinstance(error, ServiceUnavailable) and error.code == "timeout"
    ((outputs, error),) = handed["gone"]
    assert outputs is None and error.status_code == 499
    assert model.batches == [2, 1]  # the gone request's row never ran


async def until_handed(handed: list, seconds: float = 5) -> None:
    async with asyncio.timeout(seconds):
        while not handed:
            await asyncio.sleep(0.005)
