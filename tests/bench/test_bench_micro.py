"""The in-process tuning benchmark compares options against what the service really runs."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from bench import micro
from service.settings import Settings

SPINNING = "session.intra_op.allow_spinning"


def _spinning(options: ort.SessionOptions) -> str:
    return options.get_session_config_entry(SPINNING)


def test_baseline_is_the_service_default(monkeypatch: pytest.MonkeyPatch):
    # The environment of the shell that runs the benchmark must not move its baseline.
    monkeypatch.setenv("VITSERVE_ALLOW_SPINNING", "true")
    default_spinning = Settings.model_fields["allow_spinning"].default
    baseline = micro.options()
    assert _spinning(baseline) == ("1" if default_spinning else "0")
    assert baseline.intra_op_num_threads == Settings.model_fields["intra_op_threads"].default
    assert baseline.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert micro.SERVICE_LABEL.endswith(f"spinning {'on' if default_spinning else 'off'}")


def test_each_variant_changes_one_thing():
    baseline = micro.options()
    flipped = micro.options(spinning=micro.OTHER_SPINNING)
    assert _spinning(flipped) != _spinning(baseline)
    one_thread = micro.options(intra=1)
    assert one_thread.intra_op_num_threads == 1
    assert _spinning(one_thread) == _spinning(baseline)
    basic = micro.options(level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    assert basic.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert _spinning(basic) == _spinning(baseline)


def test_session_table_starts_with_the_service(tmp_path):
    configs = micro.session_configs(2, tmp_path / "offline.onnx")
    first = next(iter(configs))
    assert first == f"{micro.SERVICE_LABEL}, ENABLE_ALL"
    assert micro.OTHER_SPINNING_LABEL in configs
