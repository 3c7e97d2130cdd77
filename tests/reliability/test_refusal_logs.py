"""Logs that tell the truth: expected refusals (503) are warnings, at most one line a code
per window, never an ERROR per request (5,687 lines in 20 s under a flood); a queue-full refusal
leaves no "coroutine 'client_gone' was never awaited" behind."""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.errors import ServiceUnavailable
from service.launcher.local_app import local_app
from service.observability import refusals
from tests.support import MODEL_NAME, RELIABILITY, make_settings

BODY = {"images": [{"pixels": [[0] * 28] * 28}]}


@pytest.fixture
def client(model_repository) -> Iterator[TestClient]:
    with TestClient(local_app(make_settings(model_repository, RELIABILITY))) as test_client:
        yield test_client


def refuse_when_queued(client: TestClient, monkeypatch, first_admits: int) -> None:
    """The classifier's queue refuses after ``first_admits`` admissions (as a queue that filled
    while the request was being decoded)."""
    batcher = client.app.state.frontend.engine.engine.manager.resolve(MODEL_NAME).classifier
    real, calls = batcher.admit, []

    def admit(count: int) -> None:
        calls.append(count)
        if len(calls) > first_admits:
            raise ServiceUnavailable("the queue is full (max_queue_size=1)", code="queue_full")
        real(count)

    monkeypatch.setattr(batcher, "admit", admit)


def test_a_refusal_after_decoding_leaves_no_coroutine_unawaited(client, monkeypatch):
    refuse_when_queued(client, monkeypatch, first_admits=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert client.post("/predict", json=BODY).status_code == 503
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], caught


def test_expected_refusals_are_rate_limited_warnings(client, monkeypatch, caplog):
    refusals._last.clear()
    refuse_when_queued(client, monkeypatch, first_admits=0)
    with caplog.at_level(logging.INFO, logger="vitserve"):
        for _ in range(40):
            assert client.post("/predict", json=BODY).status_code == 503
    lines = [r for r in caplog.records if "queue_full" in r.getMessage()]
    assert not [r for r in lines if r.levelno >= logging.ERROR]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
