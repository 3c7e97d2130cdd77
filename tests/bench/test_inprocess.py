"""The in-process measurements run the real model: a tiny run of each (about a second)."""

from __future__ import annotations

from bench.inprocess import Ceiling, model_cost
from bench.payloads import b64_pngs
from bench.server_process import REPO

MODEL_DIR = REPO / "models" / "fashion-mnist-vit" / "1"


def test_model_cost_per_image_at_each_batch_size():
    cost = model_cost({"fp32": MODEL_DIR}, (1, 4), repeats=2, min_time_s=0.01)
    assert set(cost.ms_per_image["fp32"]) == {1, 4}
    assert all(0 < s.median < 1000 and s.n == 2 for s in cost.ms_per_image["fp32"].values())
    assert "| 4 |" in cost.markdown()


def test_the_ceiling_workers_decode_preprocess_and_run_batches():
    ceiling = Ceiling(MODEL_DIR, b64_pngs(4)[0], processes=1)
    try:
        assert len(ceiling.pids) == 1
        assert ceiling.images_per_s(4, 0.2) > 0
        assert ceiling.images_per_s(1, 0.1) > 0  # the workers take a second task
    finally:
        ceiling.close()
    assert not any(process.is_alive() for process in ceiling.processes)
