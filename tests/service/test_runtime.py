"""How many onnxruntime threads a session gets: the setting, else the cores but one shared out; and
one copy of a heavy version's weights for all its sessions, answering as plain sessions do."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from service.contract.model_config import ModelConfig, serving_config
from service.contract.model_repository import version_files
from service.engine import runtime
from service.engine.runtime import Runtime
from service.settings import Settings
from tests.support import MODEL_NAME


@pytest.mark.parametrize(
    ("cores", "instances", "threads"),
    [(1, 1, 1), (2, 1, 1), (2, 2, 1), (8, 1, 7), (8, 2, 3), (8, 16, 1), (16, 3, 5)],
)
def test_intra_op_threads_leave_a_core_to_the_event_loop(monkeypatch, cores, instances, threads):
    monkeypatch.setattr(runtime, "usable_cores", lambda: cores)
    assert runtime.intra_op_threads(Settings().runtime, instances) == threads


def test_an_explicit_thread_count_wins(monkeypatch):
    monkeypatch.setattr(runtime, "usable_cores", lambda: 8)
    assert runtime.intra_op_threads(Settings(intra_op_threads=3).runtime, 4) == 3


# --- one copy of the weights ------------------------------------------------------------------------


def _load(model_repository: Path, instances: int = 2) -> Runtime:
    serving = serving_config(ModelConfig(), {"instance_count": instances, "max_batch_size": 4})
    settings = Settings(provider="cpu", intra_op_threads=1)
    return Runtime.load(
        version_files(model_repository, MODEL_NAME, 1), settings.runtime, serving, settings.batching
    )


def _plain_session(path: Path) -> ort.InferenceSession:
    """The graph as onnxruntime opens it with its defaults: every weight its own, prepacked."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _initializer_bytes(path: Path) -> dict[str, bytes]:
    graph = onnx.load(str(path)).graph
    return {t.name: numpy_helper.to_array(t).tobytes() for t in graph.initializer}


@pytest.fixture
def shared_runtime(model_repository, monkeypatch) -> Runtime:
    """The tiny model loaded as a heavy one is: its weights shared between its sessions."""
    monkeypatch.setattr(runtime, "SHARED_WEIGHTS_FROM_BYTES", 0)
    loaded = _load(model_repository)
    gc.collect()  # nothing but the runtime may keep the shared weights alive
    return loaded


def test_shared_weights_answer_bit_identically_to_plain_sessions(shared_runtime, model_repository):
    files = version_files(model_repository, MODEL_NAME, 1)
    images = np.random.default_rng(3).standard_normal((5, 1, 28, 28), dtype=np.float32)
    (expected,) = _plain_session(files.classifier_path).run(["logits"], {"images": images})
    assert np.abs(expected).max() > 0.1  # trained weights: logits a wrong weight would change
    for instance in range(2):
        assert np.array_equal(shared_runtime.classify(images, instance), expected)
    attention = _plain_session(files.attention_path).run(None, {"images": images})
    logits, maps = shared_runtime.attend(images)
    assert np.array_equal(logits, attention[0]) and np.array_equal(maps, attention[1])


def test_the_attention_graph_takes_every_weight_from_the_classifier(
    shared_runtime, model_repository
):
    """Matched by content: the attention graph names its weights apart from the classifier's."""
    files = version_files(model_repository, MODEL_NAME, 1)
    classifier = _initializer_bytes(files.classifier_path)
    attention = _initializer_bytes(files.attention_path)
    assert set(attention) != set(classifier)  # the names differ, so names alone would not do
    assert shared_runtime.attention_shared == len(attention)
    assert shared_runtime.shared is not None
    assert shared_runtime.shared.bytes == sum(len(data) for data in set(classifier.values()))


def test_each_session_is_given_the_same_weights(model_repository, monkeypatch):
    """The OrtValues every session was created with are one set, not a copy per session."""
    monkeypatch.setattr(runtime, "SHARED_WEIGHTS_FROM_BYTES", 0)
    given: list[dict] = []
    real = runtime.open_session

    def recording(path, settings, instances=1, initializers=None):
        given.append(dict(initializers or {}))
        return real(path, settings, instances, initializers)

    monkeypatch.setattr(runtime, "open_session", recording)
    _load(model_repository, instances=2)
    first, second, attention = given
    assert first and first.keys() == second.keys()
    assert all(first[name] is second[name] for name in first)
    held = {id(value) for value in first.values()}
    assert attention and all(id(value) in held for value in attention.values())


def test_a_small_model_keeps_a_copy_per_session(model_repository):
    """Below SHARED_WEIGHTS_FROM_BYTES prepacked copies are cheaper than sharing (BENCHMARKS.md)."""
    assert (model_repository / MODEL_NAME / "1" / "model.onnx").stat().st_size < (
        runtime.SHARED_WEIGHTS_FROM_BYTES
    )
    loaded = _load(model_repository)
    assert loaded.shared is None and loaded.attention_shared == 0
