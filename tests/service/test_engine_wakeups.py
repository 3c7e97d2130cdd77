"""What wakes the engine's event loop: a finished batch wakes it once however many batches finished
while it was busy, and under load (every instance busy) neither queuing nor a finished batch that
starts the next wakes the batching loop's task."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from tests.service.test_batcher_contract import Model, make, rows
from tests.service.test_link import until
from tests.support import submit


def test_batches_that_finish_while_the_loop_is_busy_wake_it_once():
    model = Model(held=2)  # each batch waits at a gate

    async def scenario():
        loop = asyncio.get_running_loop()
        b = make([model, model], max_batch_size=1)  # two instances; each request a full batch
        b.start()
        calls = [asyncio.create_task(submit(b, rows(value))) for value in (1.0, 2.0)]
        await until(
            lambda: len(b._instances.running) == 2, seconds=30
        )  # one batch on each instance
        wakes = []
        wake = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakes.append(callback.__name__)
            return wake(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        for gate in model.gates:
            gate.set()
        deadline = time.monotonic() + 30
        while len(b._instances._finished) < 2:  # the loop stays busy while both batches end
            assert time.monotonic() < deadline, "the batches never finished"
            time.sleep(0.001)
        answers = await asyncio.gather(*calls)
        await b.stop(5)
        return wakes, answers

    wakes, answers = asyncio.run(scenario())
    assert wakes == ["_take_finished"]
    assert [float(outputs[0][0]) for outputs in answers] == [1.0, 2.0]


def test_under_load_queuing_and_finished_batches_leave_the_batching_loop_asleep():
    """One instance, held busy: what is queued meanwhile waits for it (no instance idle, so no
    queue delay to wait out), and the batch's end starts the next batch itself."""
    model = Model()
    model.gate.clear()

    async def scenario():
        b = make(model, max_batch_size=2, max_queue_delay_s=60.0)
        b.start()
        await asyncio.sleep(0)  # the batching loop is waiting
        first = asyncio.create_task(submit(b, rows(1.0)))
        await until(lambda: bool(b._instances.running), seconds=30)
        sets = []
        wake = b._wakeup.set

        def counted() -> None:
            sets.append(time.monotonic())
            wake()

        b._wakeup.set = counted  # type: ignore[method-assign]
        queued = [asyncio.create_task(submit(b, rows(value))) for value in (2.0, 3.0)]
        await until(lambda: b.queued == 2, seconds=30)
        model.gate.set()
        answers = await asyncio.gather(first, *queued)
        woken = len(sets)
        await b.stop(5)
        return woken, answers, model.batches

    woken, answers, batches = asyncio.run(scenario())
    assert woken == 0
    assert batches == [1, 2]  # the queued pair ran together, started by the first batch's end
    np.testing.assert_array_equal([outputs[0][0] for outputs in answers], [1.0, 2.0, 3.0])
