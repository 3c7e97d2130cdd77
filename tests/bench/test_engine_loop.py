"""bench/engine_loop.py: the near-free model is one the service loads as the shipped model's (same
name, input, labels, metadata and config) and answers [N, classes] with almost no work."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort

from bench.engine_loop import SHIPPED, free_repository
from service.engine.core import Engine
from service.observability.metrics import Metrics
from tests.support import REPO, make_settings


def test_the_free_model_is_served_as_the_shipped_one(tmp_path):
    repository = free_repository(tmp_path)
    session = ort.InferenceSession(str(repository / SHIPPED / "1" / "model.onnx"))
    shipped = ort.InferenceSession(str(REPO / "models" / SHIPPED / "1" / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == [i.name for i in shipped.get_inputs()]
    meta, shipped_meta = session.get_modelmeta(), shipped.get_modelmeta()
    assert meta.custom_metadata_map == shipped_meta.custom_metadata_map
    rows = np.zeros((3, 1, 28, 28), np.float32)
    (logits,) = session.run(None, {session.get_inputs()[0].name: rows})
    (expected,) = shipped.run(None, {shipped.get_inputs()[0].name: rows})
    assert logits.shape == expected.shape

    async def served() -> tuple[str, int]:
        engine = Engine(make_settings(repository, model_name=SHIPPED), Metrics())
        await engine.start()
        view = engine.table().resolve(SHIPPED)
        await engine.stop()
        return view.name, len(view.metadata.labels)

    assert asyncio.run(served()) == (SHIPPED, expected.shape[1])
