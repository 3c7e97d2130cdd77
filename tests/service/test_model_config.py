"""config.pbtxt: Triton's ModelConfig read and written, the serving settings taken from it, and
Triton's version policies. The config texts are written by hand in the syntax of Triton's
docs/user_guide/model_configuration.md, not produced by the code under test."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from service.contract import model_config as mc
from service.contract.model_config import (
    ModelConfigError,
    ServingConfig,
    default_model_config,
    parse_model_config,
    read_model_config,
    select_versions,
    serving_config,
    write_model_config,
)

# Triton's documented forms: `dims: [ ... ]`, `version_policy: { ... }`, lists of groups.
FULL = """
name: "fashion"
platform: "onnxruntime_onnx"
max_batch_size: 48
input [
  {
    name: "images"
    data_type: TYPE_FP32
    dims: [ 1, 28, 28 ]
  }
]
output [
  {
    name: "logits"
    data_type: TYPE_FP32
    dims: [ 10 ]
    label_filename: "labels.txt"
  }
]
dynamic_batching {
  preferred_batch_size: [ 8, 16 ]
  max_queue_delay_microseconds: 1500
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 250000
    allow_timeout_override: true
    max_queue_size: 100
  }
}
version_policy: { specific: { versions: [1, 3] }}
instance_group [
  {
    count: 2
    kind: KIND_CPU
  },
  {
    count: 1
    kind: KIND_GPU
    gpus: [ 0 ]
  }
]
"""

MINIMAL = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 5 ] } ]
"""


def test_every_setting_is_read_from_a_hand_written_config():
    config = parse_model_config(FULL)
    assert config.name == "fashion" and list(config.input[0].dims) == [1, 28, 28]
    assert config.output[0].label_filename == "labels.txt"
    assert serving_config(config) == ServingConfig(
        max_batch_size=48,
        max_queue_delay_s=0.0015,
        preferred_batch_sizes=(8, 16),
        max_queue_size=100,
        request_timeout_s=0.25,
        instance_count=3,
        version_policy=("specific", (1, 3)),
    )


def test_a_minimal_config_gets_triton_defaults():
    """No dynamic_batching, version_policy or instance_group: latest 1, one instance, no limits."""
    assert serving_config(parse_model_config(MINIMAL)) == ServingConfig(
        max_batch_size=8,
        max_queue_delay_s=0.0,
        preferred_batch_sizes=(),
        max_queue_size=None,
        request_timeout_s=None,
        instance_count=1,
        version_policy=("latest", 1),
    )


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("version_policy: { all { }}", ("all",)),
        ("version_policy: { all: {}}", ("all",)),
        ("version_policy: { latest: { num_versions: 2}}", ("latest", 2)),
        ("version_policy: { specific: { versions: [1,3]}}", ("specific", (1, 3))),
    ],
)
def test_the_three_documented_version_policies(text, policy):
    assert serving_config(parse_model_config(MINIMAL + text)).version_policy == policy


def test_an_instance_group_without_count_counts_one():
    text = MINIMAL + "instance_group [ { kind: KIND_CPU }, { count: 3 kind: KIND_CPU } ]"
    assert serving_config(parse_model_config(text)).instance_count == 4


def test_overrides_win_over_the_file_and_none_means_unset():
    config = parse_model_config(FULL)
    serving = serving_config(
        config,
        {"max_batch_size": 16, "max_queue_delay_s": 0.004, "instance_count": None},
    )
    assert serving.max_batch_size == 16 and serving.max_queue_delay_s == 0.004
    assert serving.instance_count == 3 and serving.max_queue_size == 100  # from the file


def test_an_override_can_repair_what_the_file_gets_wrong():
    config = parse_model_config(MINIMAL.replace("max_batch_size: 8", "max_batch_size: 0"))
    with pytest.raises(ModelConfigError, match=r"max_batch_size must be 1 or more.*got 0"):
        serving_config(config)
    assert serving_config(config, {"max_batch_size": 4}).max_batch_size == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_sise": 4}, r"unknown serving settings \['max_batch_sise'\]"),
        ({"instance_count": 0}, "instance_count must be 1 or more, got 0"),
        ({"max_queue_size": 0}, "max_queue_size must be 1 or more, got 0"),
        ({"request_timeout_s": -1.0}, "request_timeout_s must be above 0"),
        ({"max_queue_delay_s": -0.1}, "max_queue_delay_s must be 0 or more"),
        (
            {"preferred_batch_sizes": (4, 64)},
            r"preferred_batch_sizes must lie in 1..max_batch_size=48, got 64",
        ),
        ({"version_policy": ("latest", 0)}, "version_policy must be"),
        ({"version_policy": ("newest", 1)}, "version_policy must be"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(overrides, message):
    with pytest.raises(ModelConfigError, match=message) as error:
        serving_config(parse_model_config(FULL), overrides)
    assert "'fashion'" in str(error.value)


def test_a_bad_file_is_refused_naming_the_file_and_the_line(tmp_path: Path):
    path = tmp_path / "config.pbtxt"
    path.write_text(FULL.replace("    dims: [ 10 ]", "    dim: [ 10 ]"))
    line = FULL.splitlines().index("    dims: [ 10 ]") + 1
    with pytest.raises(ModelConfigError) as error:
        read_model_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: line {line}, column 5:")
    assert 'has no field named "dim"' in message


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (("TYPE_FP32", "TYPE_FLOAT32"), "TYPE_FLOAT32"),
        (("KIND_CPU", "KIND_TPU"), "KIND_TPU"),
        (("max_queue_size: 100", "max_queue_size: -1"), "max_queue_size"),
        (("\n]\ndynamic_batching", "\ndynamic_batching"), "Expected"),
    ],
    ids=["unknown-type", "unknown-kind", "negative-unsigned", "unbalanced"],
)
def test_what_triton_refuses_is_refused(change, found):
    assert change[0] in FULL
    with pytest.raises(ModelConfigError, match=found):
        parse_model_config(FULL.replace(change[0], change[1], 1), "m/config.pbtxt")


def test_an_unreadable_file_is_named(tmp_path: Path):
    with pytest.raises(ModelConfigError, match=r"config\.pbtxt: cannot read it"):
        read_model_config(tmp_path / "config.pbtxt")
    (tmp_path / "binary.pbtxt").write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(ModelConfigError, match=r"binary\.pbtxt: cannot read it"):
        read_model_config(tmp_path / "binary.pbtxt")


def test_the_default_config_is_what_a_hand_written_one_says(tmp_path: Path):
    written = tmp_path / "config.pbtxt"
    write_model_config(default_model_config("fashion", "images", [1, 28, 28], 10), written)
    expected = parse_model_config(
        """
        name: "fashion"
        platform: "onnxruntime_onnx"
        max_batch_size: 16
        input [ { name: "images" data_type: TYPE_FP32 dims: [ 1, 28, 28 ] } ]
        output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
        dynamic_batching {
          max_queue_delay_microseconds: 2000
          default_queue_policy { max_queue_size: 512 default_timeout_microseconds: 30000000 }
        }
        version_policy: { latest: { num_versions: 1 } }
        instance_group [ { kind: KIND_AUTO, count: 2 } ]
        """
    )
    assert read_model_config(written) == expected
    assert "dims: [1, 28, 28]" in written.read_text()  # readable by people too
    assert written.stat().st_mode & 0o777 == 0o644


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path, monkeypatch):
    path = tmp_path / "config.pbtxt"
    path.write_text(FULL)
    before = path.read_text()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mc.os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        write_model_config(parse_model_config(MINIMAL), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.pbtxt"]
    monkeypatch.undo()

    seen = []
    stop = threading.Event()

    def read_while_writing():
        while not stop.is_set():
            try:
                seen.append(serving_config(read_model_config(path)).max_batch_size)
            except ModelConfigError as error:  # a half-written file
                seen.append(error)

    reader = threading.Thread(target=read_while_writing)
    reader.start()
    try:
        for size in (8, 48) * 25:
            text = MINIMAL.replace("max_batch_size: 8", f"max_batch_size: {size}")
            write_model_config(parse_model_config(text), path)
    finally:
        stop.set()
        reader.join()
    assert seen and set(seen) <= {8, 48}, {x for x in seen if x not in (8, 48)}
    assert sorted(os.listdir(tmp_path)) == ["config.pbtxt"]


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        (("latest", 1), [1, 2, 3], [3]),
        (("latest", 2), [3, 10, 2], [3, 10]),  # numerically greatest, not by name
        (("latest", 5), [1, 2], [1, 2]),
        (("latest", 1), [], []),
        (("all",), [2, 1, 7], [1, 2, 7]),
        (("specific", (1, 3)), [1, 2, 3, 4], [1, 3]),
        (("specific", (1, 5)), [1, 2], [1]),  # a listed version that is missing is skipped
        (("specific", (9,)), [1, 2], []),
    ],
)
def test_version_policies_select_as_triton_does(policy, available, expected):
    assert select_versions(policy, available) == expected


def test_a_bad_policy_is_refused():
    with pytest.raises(ModelConfigError, match="version_policy must be"):
        select_versions(("specific", ()), [1])
