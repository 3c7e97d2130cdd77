"""One client cannot change another's answer: the shipped int8 model gets bit-identical
logits for an image alone and batched with hostile partners, through the real dynamic batcher.

Before: dynamically quantized (one activation scale per batch), a partner tensor full of 1000.0
changed the class of 588 of 923 answers. Now the model is static QDQ (scales fixed at calibration,
export/quantize.py), and partners are within the model's input range (FP32 elements outside it are
refused, test_strict_json_out.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.contract.preprocessing import normalise
from service.launcher.local_app import local_app
from tests.support import RELIABILITY, REPO, make_settings, submit

INT8 = "fashion-mnist-vit-int8"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = make_settings(
        REPO / "models",
        RELIABILITY,
        models=INT8,
        model_name=INT8,
        max_batch_size=32,
        max_queue_delay_ms=200.0,
        max_queue_size=256,
    )
    with TestClient(local_app(settings)) as test_client:
        yield test_client


def test_an_image_gets_the_same_logits_whatever_it_is_batched_with(client, fashion_images):
    pipeline = client.app.state.frontend.engine.engine.manager.resolve(INT8)
    meta = pipeline.metadata
    images = normalise(fashion_images[:, None].astype(np.float32), meta.preprocessing)
    low, high = meta.input_range
    rng = np.random.default_rng(25)
    partners = [
        np.full((7, 1, 28, 28), high, np.float32),
        np.full((15, 1, 28, 28), low, np.float32),
        rng.uniform(low, high, (24, 1, 28, 28)).astype(np.float32),
        np.where(rng.random((31, 1, 28, 28)) < 0.5, low, high).astype(np.float32),
    ]
    batcher = pipeline.classifier

    async def alone(rows: np.ndarray) -> np.ndarray:
        return (await submit(batcher, rows))[0]

    async def beside(rows: np.ndarray, hostile: np.ndarray) -> np.ndarray:
        mine, _ = await asyncio.gather(alone(rows), alone(hostile))
        return mine

    changed = 0
    for index in range(len(images)):
        row = images[index : index + 1]
        reference = client.portal.call(alone, row)
        for hostile in partners:
            executions = batcher.statistics.execution_count
            got = client.portal.call(beside, row, hostile)
            assert batcher.statistics.execution_count == executions + 1, "not one batch"
            changed += not np.array_equal(got, reference)
    assert changed == 0, f"{changed} of {len(images) * len(partners)} answers changed"
