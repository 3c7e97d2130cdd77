"""The shadow benchmark's logic: the share compared, the medians and ratios it reports, the repository
it serves. The run itself needs two services and hey (``python -m bench.shadow``)."""

from __future__ import annotations

from pathlib import Path

from bench.shadow import MODEL, ShadowBench, Window, repository
from service.contract.candidate_plan import candidate_plan
from service.contract.model_config import read_model_config


def window(arm: str, concurrency: int, images_s: float, p99: float, **outcomes: int) -> Window:
    return Window(arm, concurrency, images_s, p99, 0, outcomes)


def test_the_share_compared_counts_every_copy_of_the_window():
    assert window("shadow", 4, 100, 10, compared=90, shed=10).share_compared == 0.9
    assert window("none", 4, 100, 10).share_compared is None


def test_the_table_gives_medians_and_the_shadowed_arm_over_the_other():
    windows = [
        *(window("none", 64, rate, 200) for rate in (400, 500, 600)),
        *(window("shadow", 64, rate, 220, compared=1, shed=9) for rate in (380, 450, 900)),
        *(window("none", 4, 200, 20) for _ in range(3)),
        *(window("shadow", 4, 180, 30, compared=19, shed=1) for _ in range(3)),
    ]
    text = ShadowBench(windows, 0, 32, 1.0, ["python -m bench.shadow"]).markdown()
    assert (
        "| c=64 | 500 (400-600) | 450 (380-900) | 0.90 | 200.0 (200.0-200.0) "
        "| 220.0 (220.0-220.0) | 1.10 | 10% (10%-10%) |"
    ) in text
    assert (
        "| c=4 | 200 (200-200) | 180 (180-180) | 0.90 | 20.0 (20.0-20.0) "
        "| 30.0 (30.0-30.0) | 1.50 | 95% (95%-95%) |"
    ) in text
    assert "shed: 27 at c=64, 3 at c=4" in text and "over 3 repeats" in text
    assert "0 of 32" in text


def test_each_arm_serves_both_versions_and_only_one_names_a_candidate(tmp_path: Path):
    for shadow in (False, True):
        model = repository(tmp_path, shadow) / MODEL
        plan = candidate_plan(read_model_config(model / "config.pbtxt"))
        assert (model / "2" / "model.onnx").is_file()
        assert plan.live_version == 1
        assert (plan.candidate_version, plan.shadow_percent) == (
            (2, 100.0) if shadow else (None, 0)
        )


def test_the_latency_gate_is_read_from_the_shadowed_arm_with_its_pairs():
    windows = [
        Window("shadow", 64, 500, 200, 0, {"compared": 5}, 1.1, 40),
        Window("shadow", 4, 200, 20, 0, {"compared": 50}, 0.9, 400),
        Window("shadow", 4, 200, 20, 0, {"compared": 50}, 1.0, 900),
        Window("none", 4, 200, 20, 0, {}, None, 0),
    ]
    text = ShadowBench(windows, 0, 32, 1.0, ["python -m bench.shadow"], busy=2).markdown()
    assert "with 2 processes spinning on the CPU throughout" in text
    assert "1.000 (0.900-1.100) (median, min-max over 3 windows)" in text
    assert "resting on 900 timed pairs by the end" in text
