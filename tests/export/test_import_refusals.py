"""What an imported checkpoint may not be: each refused with a message that names the problem,
before a model is built where the config is at fault, and with nothing written."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import export.importers
from export import onnx as onnx_export
from export.checkpoint import CheckpointError
from export.cli import version_number
from export.importers import load_imported
from export.repository import RepositoryError
from service.contract.model_repository import MAX_VERSION
from tests.export.test_import_timm import write_checkpoint

CASE = "deit-tiny-distilled-patch16"


def timm_checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "timm"
    write_checkpoint(directory, CASE)
    return directory


def hf_checkpoint(tmp_path: Path) -> Path:
    """A Hugging Face ViT directory as transformers writes it, its weights under their disk names."""
    from tests.export.test_import_huggingface import saved

    directory, _ = saved(tmp_path, "vit-tiny-patch16")
    return directory


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def refused(directory: Path, tmp_path: Path, capsys) -> str:
    """Runs the export command; returns its error, having checked that nothing was written."""
    repo = tmp_path / "repo"
    code = onnx_export.main([str(directory), "--name", "m", "--version", "1", "--repo", str(repo)])
    assert code == 1
    assert not (repo / "m" / "1").exists()
    return capsys.readouterr().err


def test_a_missing_weight_is_refused_with_its_name(tmp_path, capsys):
    directory = hf_checkpoint(tmp_path)
    name = "vit.encoder.layer.1.attention.attention.key.bias"
    edit_weights(directory, lambda state: state.pop(name))
    err = refused(directory, tmp_path, capsys)
    assert f"missing weight(s) {name}" in err
    assert "unexpected" not in err


def test_an_extra_weight_is_refused_with_its_name(tmp_path, capsys):
    directory = timm_checkpoint(tmp_path)
    edit_weights(directory, lambda state: state.update({"blocks.0.ls1.gamma": torch.ones(192)}))
    err = refused(directory, tmp_path, capsys)
    assert "unexpected weight(s) blocks.0.ls1.gamma" in err
    assert "missing" not in err


def test_a_misshapen_weight_is_refused_with_its_name_and_shapes(tmp_path, capsys):
    directory = timm_checkpoint(tmp_path)
    edit_weights(directory, lambda state: state.update({"head.bias": torch.zeros(4)}))
    assert "head.bias has shape (4,), expected (3,)" in refused(directory, tmp_path, capsys)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path, capsys):
    directory = timm_checkpoint(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps({"head.bias": Payload()}))
    err = refused(directory, tmp_path, capsys)
    assert "weights_only=True" in err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_size": 10**9}, "dim must be an integer in [1, 8192], got 1000000000"),
        ({"num_hidden_layers": 10**6}, "depth must be an integer in [1, 128]"),
        ({"image_size": 10**5}, "image_size must be an integer in [1, 4096]"),
        (
            {"hidden_size": 8192, "intermediate_size": 65536, "num_hidden_layers": 12},
            "at most 4,000,000,000 are imported",
        ),
        ({"hidden_size": "wide"}, "dim must be an integer"),
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'; only 'gelu' (exact) is imported"),
        ({"id2label": {"0": "a", "2": "b"}}, "id2label must number the classes 0 to 1"),
    ],
)
def test_a_config_out_of_bounds_is_refused_before_a_model_is_built(
    tmp_path, monkeypatch, edit, message
):
    directory = hf_checkpoint(tmp_path)
    edit_config(directory, lambda config: config.update(edit))

    def never(*args, **kwargs):
        raise AssertionError("a model was built from a config that should have been refused")

    monkeypatch.setattr(export.importers, "VisionTransformer", never)
    with pytest.raises(CheckpointError) as error:
        load_imported(directory)
    assert message in str(error.value)


def test_an_unsupported_hugging_face_model_is_refused_naming_the_supported_ones(tmp_path, capsys):
    directory = hf_checkpoint(tmp_path)
    edit_config(
        directory, lambda config: config.update(architectures=["SwinForImageClassification"])
    )
    assert (
        "architectures ['SwinForImageClassification'] is not imported; supported: "
        "ViTForImageClassification, DeiTForImageClassification, "
        "DeiTForImageClassificationWithTeacher"
    ) in refused(directory, tmp_path, capsys)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"architecture": "vit_base_patch16_clip_224"}, "supported: vit_{tiny,small,base"),
        ({"architecture": "deit3_small_patch16_224"}, "is not imported; supported"),
        ({"model_args": {"img_size": 32, "init_values": 1e-5}}, "init_values=1e-05"),
        ({"model_args": {"img_size": 32, "reg_tokens": 4}}, "reg_tokens=4"),
        ({"model_args": {"img_size": 32, "global_pool": "map"}}, "global_pool 'map'"),
        ({"model_args": {"img_size": 32, "act_layer": "relu"}}, "model_args act_layer are not"),
        ({"label_names": ["a", "b"]}, "2 label_names for 3 classes"),
    ],
)
def test_an_unsupported_timm_model_is_refused_naming_what(tmp_path, capsys, edit, message):
    directory = timm_checkpoint(tmp_path)
    edit_config(directory, lambda config: config.update(edit))
    assert message in refused(directory, tmp_path, capsys)


def test_a_hugging_face_model_without_its_processor_is_refused(tmp_path, capsys):
    directory = hf_checkpoint(tmp_path)
    (directory / "preprocessor_config.json").unlink()
    assert "no preprocessor_config.json" in refused(directory, tmp_path, capsys)


def test_an_imported_model_is_not_quantized(tmp_path, capsys):
    directory = timm_checkpoint(tmp_path)
    repo = tmp_path / "repo"
    argv = [str(directory), "--name", "m", "--version", "1", "--repo", str(repo)]
    assert onnx_export.main([*argv, "--quantize", "int8"]) == 1
    assert "an imported checkpoint exports in float32" in capsys.readouterr().err
    assert not repo.exists()


def test_half_precision_weights_are_widened_and_integer_ones_refused(tmp_path, capsys):
    directory = timm_checkpoint(tmp_path)
    edit_weights(directory, lambda state: state.update({k: v.half() for k, v in state.items()}))
    half = load_file(str(directory / "model.safetensors"))
    model = load_imported(directory).model
    assert model.position_embedding.dtype == torch.float32
    assert torch.equal(model.position_embedding, half["pos_embed"].float())
    assert torch.equal(
        model.blocks[0].attention.qkv.weight, half["blocks.0.attn.qkv.weight"].float()
    )

    edit_weights(
        directory, lambda state: state.update({"head.bias": torch.zeros(3, dtype=torch.int64)})
    )
    assert "head.bias is not a floating-point tensor" in refused(directory, tmp_path, capsys)


class MakesADirectory:
    """Unpickled, it makes ``path``: what a malicious checkpoint's code could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_torch_save_zip_whose_pickle_runs_code_is_refused_without_running_it(tmp_path, capsys):
    # torch's own zip format, as pytorch_model.bin is saved: it memory-maps, so the refusal is
    # torch.load(weights_only=True)'s, not a format error's.
    directory = timm_checkpoint(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    marker = tmp_path / "ran"
    state["head.bias"] = MakesADirectory(marker)
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    assert zipfile.is_zipfile(directory / "pytorch_model.bin")
    err = refused(directory, tmp_path, capsys)
    assert "weights_only=True" in err
    assert not marker.exists()


def nested(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("file", ["config.json", "preprocessor_config.json"])
def test_json_nested_100000_deep_is_refused_not_a_recursion_error(tmp_path, capsys, file):
    directory = hf_checkpoint(tmp_path)
    (directory / file).write_text(nested(100_000))
    err = refused(directory, tmp_path, capsys)
    assert f"{file}: objects and arrays nested 100,001 deep; a config nests at most 32" in err
    assert "Traceback" not in err


def test_json_within_the_depth_bound_reads_and_an_integer_too_long_to_read_is_refused(
    tmp_path, capsys
):
    directory = hf_checkpoint(tmp_path)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "task_specific_params": json.loads(nested(30))}))
    assert load_imported(directory).labels == [
        "tabby cat",
        "crane (class 1)",
        "crane (class 2)",
        "sports car",
    ]
    path.write_text(json.dumps(config)[:-1] + ', "big": ' + "9" * 5000 + "}")
    assert "config.json: not valid JSON (Exceeds the limit" in refused(directory, tmp_path, capsys)


@pytest.mark.parametrize("version", ["99999999999999999999999", str(2**63), "0", "9" * 5000])
def test_a_version_beyond_a_signed_64_bit_integer_is_refused_where_it_enters(
    tmp_path, capsys, version
):
    argv = [str(tmp_path), "--name", "m", "--version", version, "--repo", str(tmp_path / "repo")]
    with pytest.raises(SystemExit) as exit_:
        onnx_export.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--version: must be an integer from 1 to {MAX_VERSION}" in err
    assert "Traceback" not in err
    with pytest.raises(RepositoryError, match="a signed 64-bit integer"):
        onnx_export.export_model(tmp_path, "m", MAX_VERSION + 1, tmp_path / "repo")
    assert version_number(str(MAX_VERSION)) == MAX_VERSION == 2**63 - 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("input_size", 5, "pretrained_cfg input_size 5 is not the model's [3, 32, 32]"),
        ("mean", 5, "preprocessing the service cannot serve"),
        ("std", None, "preprocessing the service cannot serve"),
    ],
)
def test_a_timm_pretrained_cfg_entry_of_another_type_is_refused_not_a_traceback(
    tmp_path, capsys, key, value, message
):
    directory = timm_checkpoint(tmp_path)
    edit_config(directory, lambda config: config["pretrained_cfg"].update({key: value}))
    assert message in refused(directory, tmp_path, capsys)


def test_hugging_face_architectures_that_are_not_names_are_refused_not_a_traceback(
    tmp_path, capsys
):
    directory = hf_checkpoint(tmp_path)
    edit_config(directory, lambda config: config.update(architectures=[["ViT"]]))
    assert "architectures [['ViT']] is not imported" in refused(directory, tmp_path, capsys)
