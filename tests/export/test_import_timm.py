"""timm checkpoints in timm's hub layout, imported and exported, against a reference forward pass.

timm 1.0.31 cannot be imported here (it imports torchvision, which is never installed), so the
checkpoints are written as timm writes them: ``config.json`` with ``architecture``, ``model_args``,
``pretrained_cfg`` and ``label_names``, and a state dict under the names of timm's
``VisionTransformer`` and ``VisionTransformerDistilled`` (timm/models/vision_transformer.py,
deit.py). The reference is ``timm_forward`` below: those modules' forward pass written out with
torch's functions, independent of export/model.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from export import onnx as onnx_export
from export.importers import load_imported
from service.contract.model_repository import read_labels, version_files
from tests.export.import_support import (
    ATTENTION_PARITY,
    LOGITS_PARITY,
    logits_error,
    random_weight,
    served,
    without_prefix,
)

# architecture, model_args, whether saved as pytorch_model.bin
CASES = {
    # Made smaller through model_args, as timm allows (48 wide, not tiny's 192; one block): it runs
    # first and pays the exporter's warm-up, and the export's time is in tracing each block's
    # operations. What it alone checks (the distillation token and head) takes no second block;
    # the other cases map two.
    "deit-tiny-distilled-patch16": (
        "deit_tiny_distilled_patch16_224",
        {"img_size": 32, "embed_dim": 48, "num_heads": 3, "depth": 1},
        False,
    ),
    "vit-small-patch32-avg-pool-fc-norm": (
        "vit_small_patch32_224",
        {"img_size": 64, "global_pool": "avg"},
        False,
    ),
    "vit-tiny-patch16-mean-pool-no-class-token": (
        "vit_tiny_patch16_224",
        {"img_size": [32, 48], "class_token": False, "global_pool": "avg", "fc_norm": False},
        True,
    ),
    "vit-tiny-patch14-token-no-qkv-bias": (
        "vit_tiny_patch16_224",
        {"img_size": 42, "patch_size": 14, "qkv_bias": False},
        True,
    ),
}
SIZES = {"tiny": (192, 3), "small": (384, 6)}  # timm's embed_dim, num_heads
LABELS = ["n01440764", "n02102040", "n02979186"]
DESCRIPTIONS = {"n01440764": "tench", "n02102040": "English springer"}
DEPTH = 2  # blocks, unless a case's model_args say otherwise


def described(architecture: str, args: dict) -> dict:
    dim, heads = SIZES[architecture.split("_")[1]]
    dim, heads = args.get("embed_dim", dim), args.get("num_heads", heads)
    depth = args.get("depth", DEPTH)
    size = args["img_size"]
    height, width = (size, size) if isinstance(size, int) else size
    pool = args.get("global_pool", "token")
    return {
        "dim": dim,
        "heads": heads,
        "patch": args.get("patch_size", int(architecture.split("_patch")[1].split("_")[0])),
        "height": height,
        "width": width,
        "prefix": int(args.get("class_token", True)) + int("distilled" in architecture),
        "pool": pool,
        "fc_norm": pool == "avg" if args.get("fc_norm") is None else args["fc_norm"],
        "qkv_bias": args.get("qkv_bias", True),
        "distilled": "distilled" in architecture,
        "depth": depth,
    }


def timm_state(d: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict under timm's names and shapes."""
    generator = torch.Generator().manual_seed(seed)
    dim, classes = d["dim"], len(LABELS)
    patches = (d["height"] // d["patch"]) * (d["width"] // d["patch"])
    shapes = {
        "patch_embed.proj.weight": (dim, 3, d["patch"], d["patch"]),
        "patch_embed.proj.bias": (dim,),
        "pos_embed": (1, patches + d["prefix"], dim),
        "head.weight": (classes, dim),
        "head.bias": (classes,),
    }
    if d["prefix"] - d["distilled"]:
        shapes["cls_token"] = (1, 1, dim)
    if d["distilled"]:
        shapes.update(dist_token=(1, 1, dim))
        shapes.update({"head_dist.weight": (classes, dim), "head_dist.bias": (classes,)})
    norm = "fc_norm" if d["fc_norm"] else "norm"
    shapes.update({f"{norm}.weight": (dim,), f"{norm}.bias": (dim,)})
    for i in range(d["depth"]):
        b = f"blocks.{i}"
        shapes.update({f"{b}.norm1.weight": (dim,), f"{b}.norm1.bias": (dim,)})
        shapes.update({f"{b}.attn.qkv.weight": (3 * dim, dim), f"{b}.attn.proj.weight": (dim, dim)})
        if d["qkv_bias"]:
            shapes[f"{b}.attn.qkv.bias"] = (3 * dim,)
        shapes.update({f"{b}.attn.proj.bias": (dim,), f"{b}.norm2.weight": (dim,)})
        shapes.update({f"{b}.norm2.bias": (dim,), f"{b}.mlp.fc1.weight": (4 * dim, dim)})
        shapes.update({f"{b}.mlp.fc1.bias": (4 * dim,), f"{b}.mlp.fc2.weight": (dim, 4 * dim)})
        shapes[f"{b}.mlp.fc2.bias"] = (dim,)
    return {name: random_weight(name, shape, generator) for name, shape in sorted(shapes.items())}


def timm_forward(s: dict, d: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's VisionTransformer(Distilled).forward in eval mode: (logits, attention of every layer
    (batch, layers, heads, tokens, tokens))."""
    dim, heads = d["dim"], d["heads"]
    x = F.conv2d(x, s["patch_embed.proj.weight"], s["patch_embed.proj.bias"], stride=d["patch"])
    x = x.flatten(2).transpose(1, 2)
    prefix = [s[k].expand(len(x), -1, -1) for k in ("cls_token", "dist_token") if k in s]
    x = torch.cat([*prefix, x], dim=1) + s["pos_embed"]
    batch, tokens, _ = x.shape
    maps = []
    for i in range(d["depth"]):
        b = f"blocks.{i}"
        y = F.layer_norm(x, (dim,), s[f"{b}.norm1.weight"], s[f"{b}.norm1.bias"], eps=1e-6)
        qkv = F.linear(y, s[f"{b}.attn.qkv.weight"], s.get(f"{b}.attn.qkv.bias"))
        q, k, v = qkv.reshape(batch, tokens, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        attention = ((q * (dim // heads) ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        maps.append(attention)
        y = (attention @ v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + F.linear(y, s[f"{b}.attn.proj.weight"], s[f"{b}.attn.proj.bias"])
        y = F.layer_norm(x, (dim,), s[f"{b}.norm2.weight"], s[f"{b}.norm2.bias"], eps=1e-6)
        y = F.gelu(F.linear(y, s[f"{b}.mlp.fc1.weight"], s[f"{b}.mlp.fc1.bias"]))
        x = x + F.linear(y, s[f"{b}.mlp.fc2.weight"], s[f"{b}.mlp.fc2.bias"])
    if "norm.weight" in s:
        x = F.layer_norm(x, (dim,), s["norm.weight"], s["norm.bias"], eps=1e-6)
    if d["distilled"]:
        head = F.linear(x[:, 0], s["head.weight"], s["head.bias"])
        distilled = F.linear(x[:, 1], s["head_dist.weight"], s["head_dist.bias"])
        return (head + distilled) / 2, torch.stack(maps, dim=1)
    pooled = x[:, 0] if d["pool"] == "token" else x[:, d["prefix"] :].mean(dim=1)
    if "fc_norm.weight" in s:
        pooled = F.layer_norm(pooled, (dim,), s["fc_norm.weight"], s["fc_norm.bias"], eps=1e-6)
    return F.linear(pooled, s["head.weight"], s["head.bias"]), torch.stack(maps, dim=1)


def hub_config(architecture: str, args: dict, d: dict) -> dict:
    """config.json as timm's save_for_hf writes it."""
    return {
        "architecture": architecture,
        "num_classes": len(LABELS),
        "num_features": d["dim"],
        "global_pool": d["pool"],
        "label_names": LABELS,
        "label_descriptions": DESCRIPTIONS,
        "model_args": {"depth": d["depth"], **args},
        "pretrained_cfg": {
            "tag": "test",
            "input_size": [3, d["height"], d["width"]],
            "fixed_input_size": True,
            "interpolation": "bicubic",
            "crop_pct": 0.9,
            "crop_mode": "center",
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            "num_classes": len(LABELS),
            "first_conv": "patch_embed.proj",
            "classifier": ["head", "head_dist"] if d["distilled"] else "head",
        },
    }


def write_checkpoint(directory: Path, case: str) -> tuple[dict, dict]:
    architecture, args, pickled = CASES[case]
    d = described(architecture, args)
    state = timm_state(d)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hub_config(architecture, args, d)))
    if pickled:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return state, d


@pytest.mark.parametrize("case", list(CASES))
def test_served_graphs_match_timms_forward(tmp_path, case):
    state, d = write_checkpoint(tmp_path / case, case)
    onnx_export.export_model(tmp_path / case, "imported", 1, tmp_path / "repo")
    metadata, classifier, attention_graph = served(tmp_path / "repo", "imported")

    images = torch.randn(3, 3, d["height"], d["width"], generator=torch.Generator().manual_seed(1))
    expected_logits, expected_maps = timm_forward(state, d, images)
    (logits,) = classifier.run(["logits"], {"images": images.numpy()})
    attention_logits, maps = attention_graph.run(
        ["logits", "attention"], {"images": images.numpy()}
    )
    assert logits_error(logits, expected_logits) <= LOGITS_PARITY
    assert logits_error(attention_logits, expected_logits) <= LOGITS_PARITY
    # The maps keep the class token that token pooling reads, and the patches.
    kept = 1 if d["pool"] == "token" else 0
    reference = without_prefix(expected_maps, list(range(kept, d["prefix"])))
    assert maps.shape == tuple(reference.shape)
    assert float(abs(maps - reference.numpy()).max()) <= ATTENTION_PARITY

    assert metadata.labels == ["tench", "English springer", "n02979186"]
    pre = metadata.preprocessing
    assert (pre.resize, pre.resample) == ("resize-crop", "bicubic")
    # timm: the shorter side to floor(size / crop_pct), then the centre crop.
    assert pre.shorter_side == max(math.floor(side / 0.9) for side in (d["height"], d["width"]))
    assert pre.mean == [0.485, 0.456, 0.406] and pre.std == [0.229, 0.224, 0.225]
    assert pre.scale == pytest.approx(1 / 255)
    assert metadata.pooling == ("token" if d["pool"] == "token" else "mean")
    card = (tmp_path / "repo" / "imported" / "MODEL_CARD.md").read_text()
    assert (
        "labels from the checkpoint's label_names, 2 replaced by their label_descriptions" in card
    )
    # a distillation head only where timm's model has one
    if d["distilled"]:
        assert '"distillation_head": true' in card
    else:
        assert '"distillation_head"' not in card and '"distillation_token": false' in card


def test_layer_norms_take_timms_epsilon_seen_on_tokens_of_tiny_variance(tmp_path):
    """timm's ViT builds every norm with eps 1e-6 (vision_transformer.py: ``partial(nn.LayerNorm,
    eps=1e-6)``). With the embeddings scaled down 1,000 times the tokens' variance is near it, where
    another epsilon (1e-5) moves the logits far beyond the parity bound; on ordinary weights it
    hides under it."""
    directory = tmp_path / "tiny-variance"
    state, d = write_checkpoint(directory, "deit-tiny-distilled-patch16")
    for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed"):
        state[name] = state[name] * 1e-3
    for name in ("cls_token", "dist_token"):
        state[name] = state[name] * 1e-3
    save_file(state, str(directory / "model.safetensors"))
    model = load_imported(directory).model
    images = torch.randn(4, 3, d["height"], d["width"], generator=torch.Generator().manual_seed(1))
    expected, _ = timm_forward(state, d, images)
    with torch.no_grad():
        logits = model(images)
    assert logits_error(logits.numpy(), expected) <= LOGITS_PARITY
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * d["depth"] + 1 and {m.eps for m in norms} == {1e-6}


def test_a_save_for_hf_checkpoint_without_label_names_is_numbered_and_says_so(tmp_path, capsys):
    """timm's ``save_for_hf`` writes ``label_names`` only for a model given them: such a checkpoint
    exports as it is, its classes numbered, and the export and the model card say why."""
    directory = tmp_path / "no-names"
    write_checkpoint(directory, "vit-tiny-patch14-token-no-qkv-bias")
    path = directory / "config.json"
    config = json.loads(path.read_text())
    del config["label_names"], config["label_descriptions"]
    path.write_text(json.dumps(config))
    repo = tmp_path / "repo"
    argv = [str(directory), "--name", "plain", "--version", "1", "--repo", str(repo)]
    assert onnx_export.main(argv) == 0
    why = (
        "numbered 'class 0' to 'class 2': the checkpoint has no label_names (timm's save_for_hf "
        "writes them only for a model given them), only num_classes 3"
    )
    out, err = capsys.readouterr()
    assert f"labels: {why}" in err
    assert json.loads(out)["source"]["labels"] == why
    files = version_files(repo, "plain", 1)
    assert read_labels(files.labels_path.read_text()) == ["class 0", "class 1", "class 2"]
    card = (repo / "plain" / "MODEL_CARD.md").read_text()
    assert f"3 classes (labels.txt); labels {why}." in card
