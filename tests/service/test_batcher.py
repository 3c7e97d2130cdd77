"""The dynamic batcher on its own: batching, ordering, splitting, queue policy, failures, draining."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from PIL import Image

from service.contract.preprocessing import Preprocessor
from service.engine import batch_runs as batcher_module
from service.engine.batcher import DynamicBatcher
from service.errors import InferenceFailed, ServiceUnavailable
from service.observability.metrics import Metrics
from tests.support import HoldFirstCall, assert_error, encode, submit


class Model:
    """Returns each row's sum and the size of the batch it ran in; can be held or made to fail."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.batches: list[int] = []
        self.seconds = seconds
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.gate.wait(10)
        time.sleep(self.seconds)
        if (images == -1).any():
            raise ValueError("poisoned row")
        self.batches.append(len(images))
        return images.reshape(len(images), -1).sum(axis=1), np.full(len(images), len(images))


def batcher(model: Model | list, **options) -> DynamicBatcher:
    """A batcher of ``model`` (or of one instance per item of a list) with these tests' limits."""
    values = {
        "max_batch_size": 8,
        "max_queue_delay_s": 0.05,
        "max_queue_size": 64,
        "timeout_s": 10.0,
        "retry_after_s": 2,
        "metrics": Metrics(),
    }
    values.update(options)
    return DynamicBatcher("test", model, **values)


def rows(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32).reshape(-1, 1, 1, 1)


def run(coroutine):
    return asyncio.run(coroutine)


def test_concurrent_requests_are_batched_and_get_their_own_rows():
    async def scenario():
        model = Model()
        b = batcher(model)
        b.start()
        answers = await asyncio.gather(*(submit(b, rows(i)) for i in range(20)))
        await b.stop(5)
        return model, answers

    model, answers = run(scenario())
    assert [float(answer[0][0]) for answer in answers] == list(range(20))
    assert sum(model.batches) == 20
    assert max(model.batches) == 8 and len(model.batches) <= 4  # 20 requests, at most 8 per batch


def test_a_request_is_split_across_batches_in_order():
    async def scenario():
        model = Model()
        b = batcher(model, max_batch_size=3)
        b.start()
        answer = await submit(b, rows(*range(7)))
        await b.stop(5)
        return model, answer

    model, answer = run(scenario())
    assert answer[0].tolist() == list(range(7))
    assert model.batches == [3, 3, 1]


def test_an_idle_batcher_runs_at_once_and_batches_what_arrives_while_busy():
    """A lone request is not held for the queue delay; partners gather while a batch runs."""

    async def scenario():
        model = Model()
        model.gate.clear()  # the first batch holds the only instance
        b = batcher(model, max_batch_size=100, max_queue_delay_s=30.0)
        b.start()
        started = time.perf_counter()
        first = asyncio.create_task(submit(b, rows(1)))
        await asyncio.sleep(0.2)
        later = [asyncio.create_task(submit(b, rows(v))) for v in (2, 3)]
        await asyncio.sleep(0.2)
        model.gate.set()
        await asyncio.gather(first, *later)
        finished = time.perf_counter()
        await b.stop(5)
        return model, finished - started

    model, took = run(scenario())
    assert model.batches == [1, 2]  # the first alone at once; the two that came meanwhile together
    assert took < 5  # not after the 30 s delay


def test_one_client_is_never_held_for_the_queue_delay():
    """A client that sends its next request as soon as the last is answered comes back sooner than
    the queue delay; with every instance idle its requests still run at once, every time."""

    async def scenario():
        model = Model()
        b = batcher(model, max_queue_delay_s=0.5)
        b.start()
        started = time.perf_counter()
        for value in range(6):
            await submit(b, rows(value))
        took = time.perf_counter() - started
        await b.stop(5)
        return model, took

    model, took = run(scenario())
    assert model.batches == [1] * 6
    assert took < 0.4, took  # a request held for the delay alone would take 0.5 s


class ThreadRecorder(Model):
    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(seconds)
        self.threads: list[int] = []

    def __call__(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.threads.append(threading.get_ident())
        return super().__call__(images)


def test_a_lone_image_of_a_fast_model_runs_on_the_event_loop(monkeypatch):
    """No thread hop for a lone image once a lone run is known to be short; partners, and a model
    slower than INLINE_RUN_MAX_S, keep the instance's thread (the loop stays free)."""

    async def scenario(model):
        b = batcher(model)
        b.start()
        for value in range(3):
            await submit(b, rows(value))  # lone images, one after another
        await asyncio.gather(*(submit(b, rows(v)) for v in range(4)))  # four at once: a batch
        await b.stop(5)
        return threading.get_ident()

    # thresholds far from the runs' times, so that a loaded machine cannot move a run across
    monkeypatch.setattr(batcher_module, "INLINE_RUN_MAX_S", 1.0)
    fast = ThreadRecorder()
    loop_thread = run(scenario(fast))
    assert fast.batches == [1, 1, 1, 4]
    # the first lone run is timed on the thread; the next two run on the loop; the batch of four
    # goes back to the thread
    assert fast.threads[0] != loop_thread
    assert fast.threads[1:3] == [loop_thread, loop_thread]
    assert fast.threads[3] != loop_thread

    monkeypatch.setattr(batcher_module, "INLINE_RUN_MAX_S", 0.002)
    slow = ThreadRecorder(seconds=0.05)
    loop_thread = run(scenario(slow))
    assert loop_thread not in slow.threads


async def inline_ready(model: Model) -> DynamicBatcher:
    """A started batcher whose next lone runs are inline (with INLINE_RUN_MAX_S at 1 s): its first,
    timed on the thread, was short."""
    b = batcher(model)
    b.start()
    await submit(b, rows(1))
    return b


def test_a_lone_image_failing_on_the_event_loop_fails_only_its_request(monkeypatch):
    monkeypatch.setattr(batcher_module, "INLINE_RUN_MAX_S", 1.0)

    async def scenario():
        b = await inline_ready(Model())
        with pytest.raises(InferenceFailed):
            await submit(b, rows(-1))
        answer = await submit(b, rows(2))
        await b.stop(5)
        return answer

    assert float(run(scenario())[0][0]) == 2.0


def test_a_call_alone_on_an_idle_model_is_answered_in_its_first_step(monkeypatch):
    """``alone`` (no partner can come this turn): an idle model starts on the call from ``submit``
    itself, so a lone image of a fast model is answered before the call awaits anything; without it
    the batching loop starts the call a turn later. A call ``alone`` behind one already queued takes
    it along."""
    monkeypatch.setattr(batcher_module, "INLINE_RUN_MAX_S", 1.0)

    async def scenario():
        model = Model()
        b = await inline_ready(model)
        done_after_one_step = []
        for alone in (True, False):
            call = asyncio.create_task(submit(b, rows(2), alone=alone))
            await asyncio.sleep(0)  # the call's first step runs, and nothing after it
            done_after_one_step.append(call.done())
            await call
        queued = asyncio.create_task(submit(b, rows(3)))
        behind = asyncio.create_task(submit(b, rows(4), alone=True))
        answers = await asyncio.gather(queued, behind)
        await b.stop(5)
        return model, done_after_one_step, answers

    model, done_after_one_step, answers = run(scenario())
    assert done_after_one_step == [True, False]
    assert model.batches == [1, 1, 1, 2]
    assert [float(answer[0][0]) for answer in answers] == [3.0, 4.0]


def test_max_queue_delay_counts_from_the_oldest_item_while_an_instance_is_busy():
    """With an instance busy and one idle, a batch waits the delay from its oldest item."""

    async def scenario():
        model = Model()
        held_first = HoldFirstCall(model)
        b = batcher([held_first, held_first], max_batch_size=100, max_queue_delay_s=1.0)
        b.start()
        held = asyncio.create_task(submit(b, rows(0)))  # every instance idle: runs at once, held
        await asyncio.sleep(0.1)
        started = time.perf_counter()
        first = asyncio.create_task(submit(b, rows(1)))
        await asyncio.sleep(0.5)
        second_sent = time.perf_counter()
        second = asyncio.create_task(submit(b, rows(2)))
        await asyncio.gather(first, second)
        finished = time.perf_counter()
        held_first.release.set()
        await held
        await b.stop(5)
        return model, finished - started, finished - second_sent

    model, first_waited, second_waited = run(scenario())
    assert model.batches == [2, 1]  # the late arrival joined the oldest item's batch
    # It ran when the first item's 1 s was up, not 1 s after the second came: the second waited
    # about 0.5 s, well under a full delay, whatever the machine's load adds.
    assert first_waited >= 0.99
    assert second_waited < 0.9, second_waited


def test_full_queue_rejects_at_once_with_retry_after():
    async def scenario():
        model = Model()
        model.gate.clear()  # the model holds its first batch
        b = batcher(model, max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=4)
        b.start()
        running = asyncio.create_task(submit(b, rows(1, 2)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(submit(b, rows(3, 4, 5, 6)))
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        with pytest.raises(ServiceUnavailable) as rejected:
            await submit(b, rows(7))
        waited = time.perf_counter() - started
        model.gate.set()
        answers = await asyncio.gather(running, queued)
        await b.stop(5)
        return rejected.value, waited, answers, b

    error, waited, answers, b = run(scenario())
    assert error.code == "queue_full" and error.status_code == 503
    assert error.headers["Retry-After"] == "2"
    assert "max_queue_size=4" in error.message
    assert waited < 5  # at once: the model holds its batch for up to 10 s
    # the admitted requests were still served
    assert [len(answer[0]) for answer in answers] == [2, 4]
    text = b._metrics.registry.get_sample_value(
        "vitserve_rejected_requests_total", {"model": "", "graph": "test", "reason": "queue_full"}
    )
    assert text == 1.0


def test_timeout_is_503_and_the_batcher_recovers():
    async def scenario():
        model = Model()
        model.gate.clear()
        b = batcher(model, timeout_s=0.1, max_queue_delay_s=0.0)
        b.start()
        with pytest.raises(ServiceUnavailable) as timed_out:
            await submit(b, rows(1))
        model.gate.set()
        answer = await submit(b, rows(5))
        await b.stop(5)
        return timed_out.value, answer

    error, answer = run(scenario())
    assert error.code == "timeout" and "request_timeout_s=0.1" in error.message
    assert error.headers["Retry-After"] == "2"
    assert float(answer[0][0]) == 5.0


def test_a_failing_batch_fails_only_its_own_requests():
    async def scenario():
        model = Model()
        b = batcher(model, max_batch_size=1, max_queue_delay_s=0.0)
        b.start()
        results = await asyncio.gather(
            submit(b, rows(1)), submit(b, rows(-1)), submit(b, rows(3)), return_exceptions=True
        )
        await b.stop(5)
        return results, b

    (good, bad, other), b = run(scenario())
    assert float(good[0][0]) == 1.0 and float(other[0][0]) == 3.0
    assert (
        isinstance(bad, InferenceFailed) and bad.status_code == 500 and "ValueError" in bad.message
    )
    failures = b._metrics.registry.get_sample_value(
        "vitserve_inference_failures_total", {"model": "", "graph": "test"}
    )
    assert failures == 1.0


def test_stop_drains_the_queue_then_refuses_work():
    async def scenario():
        model = Model(seconds=0.02)
        b = batcher(model, max_batch_size=2, max_queue_delay_s=10.0)
        b.start()
        pending = [asyncio.create_task(submit(b, rows(i))) for i in range(5)]
        await asyncio.sleep(0.01)
        await b.stop(20)  # the 10 s delay is not waited for: closing runs what is queued now
        answers = [task.result() for task in pending]
        with pytest.raises(ServiceUnavailable) as refused:
            await submit(b, rows(9))
        return answers, refused.value

    started = time.perf_counter()
    answers, refused = run(scenario())
    assert [float(answer[0][0]) for answer in answers] == list(range(5))
    assert time.perf_counter() - started < 5  # not after the 10 s delay
    assert refused.code == "shutting_down"


def test_a_full_queue_refuses_before_decoding(client, monkeypatch, fashion_images):
    """An overloaded service must not spend CPU decoding images it cannot queue."""
    pipeline = client.app.state.engine.manager.resolve()
    decoded = []
    real_from_image = Preprocessor.from_image  # decoding happens in the front end

    def counting(*args, **kwargs):
        decoded.append(1)
        return real_from_image(*args, **kwargs)

    monkeypatch.setattr(Preprocessor, "from_image", counting)
    files = [("files", (f"{i}.png", encode(fashion_images[i]), "image/png")) for i in range(2)]
    for batcher, route, payload in (
        (pipeline.classifier, "/predict", {"files": files}),
        (pipeline.attention, "/attention", {"files": {"file": files[0][1]}}),
    ):
        monkeypatch.setattr(batcher, "max_queue_size", 0)
        response = client.post(route, **payload)
        assert_error(response, 503, "queue is full", "max_queue_size=0")
        assert decoded == []
        monkeypatch.undo()
        monkeypatch.setattr(Preprocessor, "from_image", counting)
    assert client.post("/predict", files=files).status_code == 200
    assert len(decoded) == 2


def test_decoding_runs_at_most_max_concurrent_decodes_at_once(client, monkeypatch, fashion_images):
    """Large images cost memory while they decode: the service bounds how many decode at once."""
    from concurrent.futures import ThreadPoolExecutor

    limit = client.app.state.frontend.settings.limits.max_concurrent_decodes
    running, peak = 0, 0
    lock = threading.Lock()
    real_from_image = Preprocessor.from_image

    def slow_from_image(*args, **kwargs):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return real_from_image(*args, **kwargs)

    monkeypatch.setattr(Preprocessor, "from_image", slow_from_image)
    # larger than the thumbnails that are decoded on the event loop (service.engine.pipeline.INLINE_PIXELS)
    png = encode(Image.fromarray(fashion_images[0]).resize((200, 200)))
    with ThreadPoolExecutor(max_workers=3 * limit) as pool:
        responses = list(
            pool.map(
                lambda _: client.post("/predict", files={"files": ("a.png", png, "image/png")}),
                range(3 * limit),
            )
        )
    assert [r.status_code for r in responses] == [200] * (3 * limit)
    assert peak == limit


def test_an_empty_api_key_is_refused_at_start():
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="api_key is set but empty"):
        Settings(api_key="  ")


def test_only_small_images_are_decoded_on_the_event_loop(fashion_images):
    from service.frontend.inputs import RawImage
    from service.frontend.serving import INLINE_PIXELS, declared_pixels, decode_inline

    thumbnail = Image.fromarray(fashion_images[0])
    side = int(INLINE_PIXELS**0.5)
    for image_format in ("PNG", "GIF", "BMP"):
        for size in ((28, 28), (side + 1, side)):
            data = encode(thumbnail.resize(size), image_format)
            assert declared_pixels(RawImage("f", data=data)) == size[0] * size[1]
    jpeg = RawImage("f", data=encode(thumbnail, "JPEG"))
    assert declared_pixels(jpeg) is None  # unknown without parsing: decoded in a thread
    small = RawImage("f", data=encode(thumbnail))
    large = RawImage("f", data=encode(thumbnail.resize((side + 1, side))))
    assert decode_inline([small, small]) and not decode_inline([large])
    assert not decode_inline([small, jpeg])
    assert not decode_inline([small] * (INLINE_PIXELS // 784 + 1))  # the request's total counts
    assert declared_pixels(RawImage("f", pixels=[[0] * 5] * 3)) == 15
    assert declared_pixels(RawImage("f", pixels=[[[0] * 5] * 3] * 3)) == 45
