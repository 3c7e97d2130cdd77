"""``--init-from`` an imported checkpoint: a folder run starts from its weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from export import train
from export.checkpoint import file_sha256, load_checkpoint
from export.lineage import training_stages
from export.model_card import lineage_lines
from export.sample_folders import write_shapes
from tests.export.test_import_timm import write_checkpoint


def test_a_folder_run_starts_from_an_imported_checkpoint(tmp_path):
    parent = tmp_path / "timm"
    state, d = write_checkpoint(parent, "deit-tiny-distilled-patch16")
    folder = write_shapes(tmp_path / "shapes", 8, seed=0)
    out = tmp_path / "run"
    code = train.main(
        [
            *("--dataset", "folder", "--data-dir", str(folder), "--image-size", "32"),
            *("--init-from", str(parent), "--out", str(out), "--epochs", "1"),
            # a learning rate that leaves the weights where they started, to within 1e-6
            *("--lr", "1e-9", "--min-lr", "1e-10", "--weight-decay", "0"),
            *("--teacher", "none", "--no-report", "--threads", "1"),
        ]
    )
    assert code == 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["init_from"] == str(parent)
    assert settings["init_from_sha256"] == file_sha256(parent / "model.safetensors")
    model, _ = load_checkpoint(out)
    c = model.config
    kept = (c.dim, c.heads, c.depth, c.patch_size, c.distillation_token)
    assert kept == (d["dim"], d["heads"], d["depth"], 16, True)
    assert c.num_classes == 3  # circle, square, triangle: a new head
    trained = load_file(str(out / "model.safetensors"))
    # timm's names for the weights the run kept from its parent
    for ours, theirs in (
        ("blocks.0.attention.qkv.weight", "blocks.0.attn.qkv.weight"),
        ("blocks.0.mlp.fc2.bias", "blocks.0.mlp.fc2.bias"),
        ("distillation_token", "dist_token"),
        ("position_embedding", "pos_embed"),
    ):
        torch.testing.assert_close(trained[ours], state[theirs], atol=1e-6, rtol=0)

    # The model card's lineage: this run, started from the import, which is no run of ours.
    stages = training_stages(out)
    assert [stage.run_dir for stage in stages] == [out]
    assert f"started from `{parent}`, a checkpoint of another library" in lineage_lines(stages)[0]
