"""service/engine/batch_cost.py: on the CPU a heavy version is batched only where batching saves time per
image, measured at load.

The timing logic runs on fake instances that advance a clock of their own thread by a cost this test
states (so no real time is measured); the wiring runs the suite's tiny model with the measurement
replaced.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from service.contract.model_repository import version_files
from service.engine import batch_cost
from service.engine.batch_cost import BatchCost
from service.engine.model_versions import model_config, serving_settings
from service.engine.pipeline import ModelPipeline
from service.engine.runtime import Runtime
from service.observability.metrics import Metrics
from tests.support import MODEL_NAME, make_settings


class ThreadClocks:
    """A clock per thread, advanced only by the fake instances' runs."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.runs: list[int] = []

    def now(self) -> float:
        return getattr(self._local, "seconds", 0.0)

    def instance(self, fixed_ms: float, per_image_ms: float):
        """A runner whose batch of n costs ``fixed_ms + n * per_image_ms``."""

        def run(images: np.ndarray) -> None:
            self.runs.append(len(images))
            cost = (fixed_ms + len(images) * per_image_ms) / 1e3
            self._local.seconds = self.now() + cost

        return run


IMAGES = np.zeros((16, 1, 2, 2), dtype=np.float32)


@pytest.mark.parametrize("instances", [1, 2])
def test_a_heavy_model_costing_the_same_per_image_in_a_batch_is_served_one_image_at_a_time(
    instances,
):
    clocks = ThreadClocks()
    runners = [clocks.instance(fixed_ms=0.0, per_image_ms=30.0) for _ in range(instances)]
    cost = batch_cost.measure(runners, IMAGES, clock=clocks.now)
    assert cost == BatchCost(lone_ms=pytest.approx(30.0), batched_ms=pytest.approx(30.0), size=4)
    assert cost.batch_limit(16) == 1
    # every instance ran alone and in a batch of 4, in both rounds
    assert sorted(set(clocks.runs)) == [1, 4]
    assert clocks.runs.count(4) == batch_cost.ROUNDS * instances


def test_a_heavy_model_whose_batch_saves_a_tenth_keeps_the_configs_batches():
    clocks = ThreadClocks()
    # alone 40 ms; in a batch of 4 (16 + 4 x 24) / 4 = 28 ms an image: 0.7x
    cost = batch_cost.measure([clocks.instance(16.0, 24.0)], IMAGES, clock=clocks.now)
    assert cost.lone_ms == pytest.approx(40.0)
    assert cost.batched_ms == pytest.approx(28.0)
    assert cost.batch_limit(16) == 16
    # just short of a tenth saved: alone 10 ms; batched (0.3 + 4 x 9.7) / 4 = 9.775 ms
    edge = batch_cost.measure([clocks.instance(0.3, 9.7)], IMAGES, clock=clocks.now)
    assert edge.batched_ms / edge.lone_ms == pytest.approx(0.9775)
    assert edge.batch_limit(16) == 1


def test_a_light_model_is_not_timed_in_a_batch_and_keeps_the_configs_batches():
    clocks = ThreadClocks()
    cost = batch_cost.measure([clocks.instance(0.0, 0.9)], IMAGES, clock=clocks.now)
    assert cost.batched_ms is None and not cost.heavy
    assert set(clocks.runs) == {1}
    assert cost.batch_limit(16) == 16


@pytest.fixture
def served(model_repository):
    settings = make_settings(model_repository, max_batch_size=None)  # the suite's sets 8
    serving = serving_settings(
        model_config(model_repository, MODEL_NAME), MODEL_NAME, settings.batching, settings.limits
    )
    return version_files(model_repository, MODEL_NAME, 1), settings, serving


def test_the_measured_limit_is_the_classifier_batchers_and_a_light_model_keeps_its_own(
    served, monkeypatch
):
    files, settings, serving = served
    assert serving.max_batch_size > 1 and not serving.preferred_batch_sizes
    light = Runtime.load(files, settings.runtime, serving, settings.batching)
    assert light.batch_cost is not None and not light.batch_cost.heavy
    assert light.batch_limit == serving.max_batch_size

    monkeypatch.setattr(batch_cost, "measure", lambda runners, images: BatchCost(30.0, 31.0))
    heavy = Runtime.load(files, settings.runtime, serving, settings.batching)
    assert heavy.batch_limit == 1
    assert "max batch 1 (measured: 30 ms an image alone, 31 ms in a batch of 4)" in heavy.batching
    pipeline = ModelPipeline(
        MODEL_NAME, heavy, serving, settings.batching, settings.limits, Metrics()
    )
    assert pipeline.classifier.max_batch_size == 1


def test_a_config_with_preferred_sizes_is_not_measured(served, monkeypatch):
    files, settings, serving = served
    chosen = dataclasses.replace(serving, preferred_batch_sizes=(8,))

    def measure(runners, images):
        raise AssertionError("a config that chose its batch sizes was timed")

    monkeypatch.setattr(batch_cost, "measure", measure)
    runtime = Runtime.load(files, settings.runtime, chosen, settings.batching)
    assert runtime.batch_limit == chosen.max_batch_size and runtime.batch_cost is None


def test_a_max_batch_size_set_in_the_environment_is_not_measured(model_repository, monkeypatch):
    settings = make_settings(model_repository, max_batch_size=8)
    serving = serving_settings(
        model_config(model_repository, MODEL_NAME), MODEL_NAME, settings.batching, settings.limits
    )
    monkeypatch.setattr(batch_cost, "measure", lambda runners, images: BatchCost(30.0, 31.0))
    runtime = Runtime.load(
        version_files(model_repository, MODEL_NAME, 1), settings.runtime, serving, settings.batching
    )
    assert runtime.batch_limit == 8 and runtime.batch_cost is None
