"""service/engine/model_versions.py, function by function: which version a model answers with, the
serving settings a model gets (the service's bounds where its config has none, a pin, the queue that
must hold a full request), and how its files are read and named.

Written against `make mutation`'s survivors in the module (docs/testing.md); the end-to-end behaviour
(version policies, settle windows, reloads) is in tests/service/test_model_versions.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.contract.model_config import ModelConfig, serving_config
from service.contract.model_repository import ModelLoadError
from service.engine.model_versions import (
    ManagedModel,
    VersionStatus,
    default_config,
    file_signature,
    model_config,
    relative,
    scan_version,
    served_model_config,
    serving_settings,
)
from service.errors import ServiceUnavailable
from tests.model_metadata import classifier_metadata
from tests.support import make_settings


def config_only(repository: Path, **overrides: object):
    """Settings that override none of a model's batching settings (tests/support.py's do)."""
    unset = dict.fromkeys(
        ("max_batch_size", "max_queue_delay_ms", "max_queue_size", "request_timeout_s"), None
    )
    return make_settings(repository, **{**unset, **overrides})


def pipeline(tag: str) -> SimpleNamespace:
    """A stand-in for a version's ModelPipeline: only its view is read here (its metadata when a
    candidate is compared)."""
    metadata = classifier_metadata(
        name="m",
        channels=1,
        height=28,
        width=28,
        patch=4,
        mean=[0.5],
        std=[0.5],
        resize="fit-pad",
        pad_value=0,
        polarity="light-on-dark",
    )
    view = SimpleNamespace(tag=f"view of {tag}", metadata=metadata)
    return SimpleNamespace(version=int(tag.split()[0]), view=view)


def managed(**versions: tuple[str, object]) -> ManagedModel:
    model = ManagedModel(name="m", serving=None)
    for key, (state, runner) in versions.items():
        number = int(key[1:])
        model.versions[number] = VersionStatus(number, state, pipeline=runner)  # type: ignore[arg-type]
    return model


def test_only_ready_versions_with_a_pipeline_answer_the_newest_first():
    v1, v3, v10 = pipeline("1"), pipeline("3"), pipeline("10")
    model = managed(
        v10=("READY", v10),
        v3=("READY", v3),
        v7=("LOADING", pipeline("7")),
        v1=("READY", v1),
        v4=("UNAVAILABLE", None),
        v5=("READY", None),  # ready in name only: no pipeline yet
        v6=("UNLOADING", pipeline("6")),
    )
    assert model.ready_versions() == [1, 3, 10]
    assert model.pipeline() is v10
    assert model.pipeline(3) is v3 and model.pipeline(1) is v1
    assert model.pipeline(7) is None and model.pipeline(5) is None and model.pipeline(6) is None
    view = model.view()
    assert view.name == "m" and view.ready == {1: v1.view, 3: v3.view, 10: v10.view}
    assert view.versions[4] == ("UNAVAILABLE", "") and view.versions[7] == ("LOADING", "")
    assert view.unloaded is False
    model.unloaded = True
    assert model.view().unloaded is True
    assert managed(v2=("LOADING", pipeline("2"))).pipeline() is None


def test_a_model_without_a_config_file_gets_the_documented_default(tmp_path):
    config = default_config("fashion")
    assert config.name == "fashion" and config.max_batch_size == 16
    serving = serving_config(config)
    assert serving.max_batch_size == 16 and serving.max_queue_delay_s == pytest.approx(0.002)
    assert serving.instance_count == 2
    (tmp_path / "fashion").mkdir()
    assert model_config(tmp_path, "fashion") == config


def test_a_config_file_is_read_and_a_bad_one_is_named_relative_to_the_repository(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nmax_batch_size: 4\n')
    assert model_config(tmp_path, "m").max_batch_size == 4
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: four\n")
    with pytest.raises(ModelLoadError) as error:
        model_config(tmp_path, "m")
    assert str(error.value).startswith("m/config.pbtxt: line 1")
    assert str(tmp_path) not in str(error.value)


def test_a_file_signature_is_its_size_and_modification_time(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"12345")
    os.utime(path, ns=(1_000_000_000, 1_234_567_891))
    assert file_signature(path) == (5, 1_234_567_891)
    assert file_signature(tmp_path / "absent") == ()


def test_the_served_config_is_a_copy_and_a_model_without_one_is_a_503():
    model = ManagedModel(name="m", serving=None, config=ModelConfig(name="m", max_batch_size=8))
    copy = served_model_config(model)
    assert copy == model.config and copy is not model.config
    copy.max_batch_size = 1
    assert model.config.max_batch_size == 8
    never = ManagedModel(name="m", serving=None)
    with pytest.raises(ServiceUnavailable) as error:
        served_model_config(never)
    assert error.value.message == "model 'm' has no valid config: not loaded"
    assert (error.value.status_code, error.value.code) == (503, "invalid_config")
    never.config_problem = "m/config.pbtxt: line 2, column 1: unknown field"
    with pytest.raises(ServiceUnavailable, match=r"no valid config: m/config.pbtxt: line 2"):
        served_model_config(never)


def test_answers_name_files_relative_to_the_repository(tmp_path):
    real = tmp_path / "store"
    real.mkdir()
    linked = tmp_path / "models"
    linked.symlink_to(real, target_is_directory=True)
    text = f"{linked}/m/1/model.onnx and {real}/m/2/model.onnx"
    assert relative(text, linked) == "m/1/model.onnx and m/2/model.onnx"
    assert relative(f"{real}/m/x", Path(f"{real}/")) == "m/x"
    assert relative(f"{real}x/m", real) == f"{real}x/m"  # only the directory, not a name's prefix
    assert relative("no path here", tmp_path) == "no path here"
    for name in ("modelsX", "models "):  # a name's own last characters are kept
        (tmp_path / name).mkdir()
        assert relative(f"{tmp_path / name}/m/1", tmp_path / name) == "m/1"


def test_a_queue_without_a_size_or_timeout_gets_the_services_bounds(tmp_path):
    settings = config_only(tmp_path)
    serving = serving_settings(
        ModelConfig(name="m", max_batch_size=4), "m", settings.batching, settings.limits
    )
    assert serving.max_queue_size == 512 and serving.request_timeout_s == 30.0
    config = ModelConfig(name="m", max_batch_size=4)
    config.dynamic_batching.default_queue_policy.max_queue_size = 64
    config.dynamic_batching.default_queue_policy.default_timeout_microseconds = 2_500_000
    serving = serving_settings(config, "m", settings.batching, settings.limits)
    assert serving.max_queue_size == 64 and serving.request_timeout_s == 2.5


def test_the_environment_overrides_the_config_and_a_pin_serves_one_version(tmp_path):
    settings = config_only(tmp_path, max_batch_size=2, max_queue_delay_ms=5)
    config = ModelConfig(name="m", max_batch_size=16)
    config.version_policy.latest.num_versions = 2
    serving = serving_settings(config, "m", settings.batching, settings.limits)
    assert serving.max_batch_size == 2 and serving.max_queue_delay_s == pytest.approx(0.005)
    assert serving.version_policy == ("latest", 2)
    assert serving_settings(config, "m", settings.batching, settings.limits, 3).version_policy == (
        "specific",
        (3,),
    )


def test_a_bad_override_is_a_load_error_naming_the_models_config(tmp_path):
    settings = config_only(tmp_path, max_batch_size=4)
    config = ModelConfig(name="m", max_batch_size=16)
    config.dynamic_batching.preferred_batch_size.append(8)
    with pytest.raises(ModelLoadError) as error:
        serving_settings(config, "m", settings.batching, settings.limits)
    assert str(error.value).startswith("m/config.pbtxt: ")
    assert "preferred_batch_sizes must lie in 1..max_batch_size=4" in str(error.value)


def test_the_queue_must_hold_a_full_sized_request(tmp_path):
    settings = config_only(tmp_path, max_images_per_request=8)
    config = ModelConfig(name="m", max_batch_size=4)
    config.dynamic_batching.default_queue_policy.max_queue_size = 8
    assert serving_settings(config, "m", settings.batching, settings.limits).max_queue_size == 8
    config.dynamic_batching.default_queue_policy.max_queue_size = 7
    with pytest.raises(ModelLoadError) as error:
        serving_settings(config, "m", settings.batching, settings.limits)
    assert str(error.value) == (
        "m: max_queue_size (7) must be at least max_images_per_request (8), or a full-sized "
        "request could never be queued"
    )


def test_a_version_that_cannot_be_read_says_why(tmp_path):
    (tmp_path / "m" / "2").mkdir(parents=True)
    files, signature, problem = scan_version(tmp_path, "m", 1)
    assert files is None and problem and "version 1 of model 'm' not found" in problem
    assert signature == ("unreadable", problem)
    files, signature, problem = scan_version(tmp_path, "m", 2)
    assert files is None and "model.onnx is missing" in problem
    assert signature == ("unreadable", problem)
    (tmp_path / "m" / "2" / "model.onnx").write_bytes(b"graph")
    files, signature, problem = scan_version(tmp_path, "m", 2)
    assert problem == "" and files is not None and files.version == 2
    assert signature == files.signature() and signature


def candidate_config(version: str) -> ModelConfig:
    config = ModelConfig()
    config.parameters["vitserve_candidate_version"].string_value = version
    return config


def test_a_model_s_signature_changes_exactly_when_its_view_does():
    """The engine rebuilds its table only when a signature changes: every change of what front ends
    see (a state, a reason, a swapped pipeline, unloaded, a refused config) must change it, and
    nothing else may."""
    model = managed(v1=("READY", pipeline("1")), v2=("LOADING", pipeline("2")))
    changes = [
        lambda: None,  # nothing
        lambda: setattr(model.versions[2], "state", "READY"),
        lambda: setattr(model.versions[1], "reason", "kept the loaded files; the new ones failed"),
        lambda: setattr(model.versions[2], "pipeline", pipeline("2 again")),
        lambda: setattr(model, "unloaded", True),
        lambda: setattr(model, "config_problem", "max_batch_size must be 1 or more"),
        lambda: setattr(model, "config", candidate_config("2")),  # the shadow's and canary's plan
        lambda: model.versions.pop(1),
        lambda: setattr(model.versions[2], "signature", ("other files",)),  # not in the view
    ]
    for change in changes:
        signature, view = model.signature(), model.view()
        change()
        assert (model.signature() != signature) == (model.view() != view), change
