"""Mapping py-spy's samples to where the time goes, on a real recording of the service under load
(tests/bench/fixtures/py-spy-service.txt, made by tests/bench/fixtures/record.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import profile
from bench.profile import DECODE, HTTP, MODEL, QUEUE, RESPONSE, Stack, bucket_of, parse_raw, split

RECORDED = parse_raw((Path(__file__).parent / "fixtures" / "py-spy-service.txt").read_text())


def modules(stack: Stack) -> list[str]:
    return [profile.frame_parts(frame)[1] for frame in stack.frames]


def test_frame_parts():
    frame = "Session.run (onnxruntime/capi/onnxruntime_inference_collection.py:395)"
    assert profile.frame_parts(frame) == (
        "run",
        "onnxruntime/capi/onnxruntime_inference_collection.py",
    )
    assert profile.frame_parts("<module> (service/__main__.py:54)") == (
        "<module>",
        "service/__main__.py",
    )


def test_the_recording_has_the_service_threads():
    assert len({s.thread for s in RECORDED}) >= 3  # the event loop, the batcher, decode workers
    assert sum(s.count for s in RECORDED) > 50


def test_every_sample_in_onnxruntime_is_the_model_run():
    inside = [s for s in RECORDED if any(m.startswith("onnxruntime/") for m in modules(s))]
    assert inside and all(bucket_of(s.frames) == MODEL for s in inside)


def test_samples_innermost_in_pillow_are_image_decode():
    stacks = [s for s in RECORDED if modules(s)[-1].startswith("PIL/")]
    assert all(bucket_of(s.frames) == DECODE for s in stacks)
    made_up = ["Thread.run (threading.py:982)", "ImageFile.load (PIL/ImageFile.py:425)"]
    assert bucket_of(made_up) == DECODE


def test_the_event_loop_thread_is_http_response_logging_or_queueing():
    buckets = {bucket_of(s.frames) for s in RECORDED if s.name == "MainThread"}
    assert HTTP in buckets and RESPONSE in buckets
    assert buckets <= {HTTP, RESPONSE, QUEUE, profile.LOGS, profile.PREPROCESS, profile.OTHER, None}


def test_blocking_waits_are_left_out():
    waits = [s for s in RECORDED if profile.frame_parts(s.frames[-1])[0] in ("wait", "_worker")]
    assert waits and all(bucket_of(s.frames) is None for s in waits)


def test_rules_name_almost_every_sample():
    kept = sum(s.count for s in RECORDED if bucket_of(s.frames) is not None)
    other = sum(s.count for s in RECORDED if bucket_of(s.frames) == profile.OTHER)
    assert other / kept < 0.05
    assert sum(share for _, share in profile.other_frames(RECORDED)) == pytest.approx(other / kept)


def test_split_shares_each_threads_cpu_over_its_samples():
    http = ["Runner.run (asyncio/runners.py:118)"]
    answer = [*http, "prediction (service/frontend/routers/predict.py:29)"]
    wait = ["Thread.run (threading.py:982)", "Condition.wait (threading.py:327)"]
    stacks = [Stack(1, http, 3), Stack(1, answer, 1), Stack(1, wait, 50), Stack(2, wait, 9)]
    seconds, unsampled = split(stacks, {1: 0.4, 2: 0.1, 3: 0.25})
    assert seconds[HTTP] == pytest.approx(0.3) and seconds[RESPONSE] == pytest.approx(0.1)
    assert seconds[QUEUE] == pytest.approx(0.1)  # thread 2 was only ever seen waiting
    assert seconds[MODEL] == pytest.approx(0.25) and unsampled == pytest.approx(0.25)


def test_split_of_the_recording_keeps_every_cpu_second():
    cpu = {thread: 0.1 * (i + 1) for i, thread in enumerate(sorted({s.thread for s in RECORDED}))}
    cpu[999_999] = 0.5  # a thread py-spy never saw
    seconds, unsampled = split(RECORDED, cpu)
    assert sum(seconds.values()) == pytest.approx(sum(cpu.values()))
    assert unsampled == pytest.approx(0.5)


def test_raw_output_without_threads_is_refused():
    with pytest.raises(ValueError, match="--threads"):
        parse_raw("_run_module_as_main (<frozen runpy>:198);main (service/__main__.py:48) 4\n")


def test_markdown_per_request_table():
    result = profile.Profile(
        20.0, 64, 1000.0, {HTTP: 0.5, MODEL: 0.5}, 0.2, [("f (x.py:1)", 0.01)], "p.svg", ["hey"]
    )
    text = result.markdown()
    assert "**1.000 core ms per request**" in text
    assert "| HTTP and JSON parsing | 0.500 | 50% |" in text and "| total | 1.000 | 100% |" in text
