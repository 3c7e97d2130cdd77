"""A timm checkpoint in timm's hub layout (``save_for_hf`` / ``push_to_hf_hub``): ``config.json``
with ``architecture``, ``num_classes``, ``model_args`` and ``pretrained_cfg``, beside
``model.safetensors`` or ``pytorch_model.bin``; ``vit_*`` and ``deit_*`` (distilled too).

The architecture's name gives its width, depth, heads, patch and image size (as timm's model
registry defines ``vit_small_patch16_224`` and the rest), and ``model_args`` what it was built
with besides; an argument that would make another model than vitserve's ViT is refused.
"""

from __future__ import annotations

import math
import re

from export.checkpoint import CheckpointError
from export.config import ViTConfig
from export.importers.labels import Labels, unique_labels
from export.importers.weights import Layout, Target, bounded_int, checked_config, sides

# (embed_dim, depth, num_heads) of timm's named sizes
SIZES = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}
NAME = re.compile(
    r"^(?P<family>vit|deit)_(?P<size>tiny|small|base|large|huge)(?P<distilled>_distilled)?"
    r"_patch(?P<patch>\d+)_(?P<image>\d+)$"
)
SUPPORTED = (
    "vit_{tiny,small,base,large,huge}_patchP_SIZE, deit_{tiny,small,base}[_distilled]_patchP_SIZE"
)
# model_args that only change training or initialisation
TRAINING_ARGS = {
    "drop_rate",
    "pos_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "patch_drop_rate",
    "weight_init",
    "fix_init",
}
# model_args accepted only at their default: anything else builds another model
DEFAULT_ONLY = {
    "init_values": None,
    "reg_tokens": 0,
    "no_embed_class": False,
    "pre_norm": False,
    "final_norm": True,
    "qk_norm": False,
    "scale_attn_norm": False,
    "scale_mlp_norm": False,
    "proj_bias": True,
    "pos_embed": "learn",
    "dynamic_img_size": False,
    "dynamic_img_pad": False,
    "pool_include_prefix": False,
}
BUILD_ARGS = {
    "img_size",
    "patch_size",
    "in_chans",
    "num_classes",
    "global_pool",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "qkv_bias",
    "class_token",
    "fc_norm",
}
# timm's defaults (timm.data.constants) where pretrained_cfg leaves them out
DEFAULT_CROP_PCT = 0.875
IMAGENET_DEFAULT_MEAN = [0.485, 0.456, 0.406]
IMAGENET_DEFAULT_STD = [0.229, 0.224, 0.225]
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box")


def parse_architecture(name: object, where: str) -> re.Match:
    match = NAME.match(name) if isinstance(name, str) else None
    if (
        match is None
        or (match["family"] == "deit" and (match["size"] not in ("tiny", "small", "base")))
        or (match["distilled"] and match["family"] != "deit")
    ):
        raise CheckpointError(
            f"{where}: timm architecture {name!r} is not imported; supported: {SUPPORTED}"
        )
    return match


def model_args(config: dict, where: str) -> dict:
    args = config.get("model_args", {})
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: model_args must be an object")
    unknown = sorted(set(args) - TRAINING_ARGS - set(DEFAULT_ONLY) - BUILD_ARGS)
    if unknown:
        raise CheckpointError(f"{where}: model_args {', '.join(unknown)} are not imported")
    changed = sorted(k for k, default in DEFAULT_ONLY.items() if k in args and args[k] != default)
    if changed:
        raise CheckpointError(
            f"{where}: model_args "
            + ", ".join(f"{k}={args[k]!r}" for k in changed)
            + " build a model other than the plain ViT this importer maps"
        )
    return args


def vit_config(config: dict, where: str) -> tuple[ViTConfig, Labels]:
    """The ViTConfig and the labels of a timm hub ``config.json``."""
    match = parse_architecture(config.get("architecture"), where)
    args = model_args(config, where)
    dim, depth, heads = SIZES[match["size"]]
    height, width = sides(where, "img_size", args.get("img_size", int(match["image"])))
    patch = sides(where, "patch_size", args.get("patch_size", int(match["patch"])))
    if patch[0] != patch[1]:
        raise CheckpointError(
            f"{where}: patch_size {list(patch)}; only square patches are imported"
        )
    dim = bounded_int(where, "embed_dim", args.get("embed_dim", dim), 1, 8192)
    ratio = args.get("mlp_ratio", 4.0)
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 16:
        raise CheckpointError(f"{where}: mlp_ratio must be in (0, 16], got {ratio!r}")
    pool = args.get("global_pool", "token")
    if pool not in ("token", "avg"):
        raise CheckpointError(f"{where}: global_pool {pool!r}; imported: 'token', 'avg'")
    stated = config.get("global_pool")
    if stated is not None and stated != pool:
        raise CheckpointError(f"{where}: global_pool {stated!r} differs from the model's {pool!r}")
    class_token = args.get("class_token", True)
    fc_norm = args.get("fc_norm")
    for name, value in (("class_token", class_token), ("qkv_bias", args.get("qkv_bias", True))):
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {name} must be true or false, got {value!r}")
    if fc_norm is not None and not isinstance(fc_norm, bool):
        raise CheckpointError(f"{where}: fc_norm must be true, false or null, got {fc_norm!r}")
    pooled_norm = pool == "avg" if fc_norm is None else fc_norm
    if pool == "token" and not class_token:
        raise CheckpointError(f"{where}: global_pool 'token' needs the class token")
    if pooled_norm and match["distilled"]:
        raise CheckpointError(f"{where}: fc_norm with a distillation token is not imported")
    pretrained = config.get("pretrained_cfg", {})
    if not isinstance(pretrained, dict):
        raise CheckpointError(f"{where}: pretrained_cfg must be an object")
    classes = config.get(
        "num_classes", args.get("num_classes", pretrained.get("num_classes", 1000))
    )
    classes = bounded_int(where, "num_classes", classes, 1, 100_000)
    values = {
        "image_height": height,
        "image_width": width,
        "in_channels": bounded_int(where, "in_chans", args.get("in_chans", 3), 1, 3),
        "patch_size": patch[0],
        "num_classes": classes,
        "dim": dim,
        "depth": args.get("depth", depth),
        "heads": args.get("num_heads", heads),
        "mlp_dim": int(dim * ratio),  # timm's Mlp: hidden_features = int(dim * mlp_ratio)
        "pooling": "token" if pool == "token" else "mean",
        "class_token": class_token,
        "pooled_norm": pooled_norm,
        "distillation_token": bool(match["distilled"]),
        "qkv_bias": args.get("qkv_bias", True),
        "layer_norm_eps": 1e-6,  # timm's LayerNorm
    }
    return checked_config(where, values), labels_of(config, pretrained, classes, where)


def labels_of(config: dict, pretrained: dict, classes: int, where: str) -> Labels:
    """``label_names`` (a list, or a mapping of class number to name), each replaced by its
    ``label_descriptions`` entry where there is one (ImageNet's synsets become words); without
    names (``save_for_hf`` writes none unless the model was given them), ``class 0`` ...
    ``class N-1`` for its ``num_classes``."""
    names = config.get("label_names", pretrained.get("label_names"))
    if names is None:
        return Labels(
            [f"class {i}" for i in range(classes)],
            f"numbered 'class 0' to 'class {classes - 1}': the checkpoint has no label_names "
            f"(timm's save_for_hf writes them only for a model given them), only num_classes "
            f"{classes}",
        )
    if isinstance(names, dict):
        try:
            names = {int(k): v for k, v in names.items()}
        except (TypeError, ValueError):
            raise CheckpointError(f"{where}: label_names keys must be class numbers") from None
        if sorted(names) != list(range(len(names))):
            raise CheckpointError(
                f"{where}: label_names must number the classes 0 to {len(names) - 1}"
            )
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list) or len(names) != classes:
        count = len(names) if isinstance(names, list | dict) else names
        raise CheckpointError(f"{where}: {count!r} label_names for {classes} classes")
    descriptions = config.get("label_descriptions", pretrained.get("label_descriptions")) or {}
    if not isinstance(descriptions, dict):
        raise CheckpointError(f"{where}: label_descriptions must be an object")
    described = sum(1 for n in names if isinstance(n, str) and n in descriptions)
    return Labels(
        unique_labels([descriptions.get(n, n) if isinstance(n, str) else n for n in names], where),
        "from the checkpoint's label_names"
        + (f", {described} replaced by their label_descriptions" if described else ""),
    )


def weight_layout(config: ViTConfig) -> Layout:
    """Every weight of timm's VisionTransformer (and VisionTransformerDistilled) state dict."""
    kinds = ("weight", "bias")
    layout: Layout = {
        "pos_embed": Target("position_embedding"),
        "patch_embed.proj.weight": Target("patch_embedding.projection.weight"),
        "patch_embed.proj.bias": Target("patch_embedding.projection.bias"),
        "head.weight": Target("head.weight"),
        "head.bias": Target("head.bias"),
    }
    if config.has_class_token:
        layout["cls_token"] = Target("class_token")
    if config.distillation_token:
        layout["dist_token"] = Target("distillation_token")
        layout.update({f"head_dist.{k}": Target(f"distillation_head.{k}") for k in kinds})
    norm = "fc_norm" if config.pooled_norm else "norm"
    layout.update({f"{norm}.{k}": Target(f"norm.{k}") for k in kinds})
    for i in range(config.depth):
        for name, ours in (
            ("norm1", "norm1"),
            ("attn.proj", "attention.projection"),
            ("norm2", "norm2"),
            ("mlp.fc1", "mlp.fc1"),
            ("mlp.fc2", "mlp.fc2"),
        ):
            layout.update(
                {f"blocks.{i}.{name}.{k}": Target(f"blocks.{i}.{ours}.{k}") for k in kinds}
            )
        for kind in kinds if config.qkv_bias else ("weight",):
            layout[f"blocks.{i}.attn.qkv.{kind}"] = Target(f"blocks.{i}.attention.qkv.{kind}")
    return layout


def preprocessing(config: dict, vit: ViTConfig, where: str) -> tuple[dict, list[str]]:
    """The ``preprocessing`` document from ``pretrained_cfg`` as timm's eval transforms read it
    (``transforms_imagenet_eval``), and notes on what the service does differently."""
    pretrained = config.get("pretrained_cfg", {})
    expected = [vit.in_channels, vit.image_height, vit.image_width]
    input_size = pretrained.get("input_size", expected)
    if input_size != expected:  # JSON's list; anything else is not the model's input either
        raise CheckpointError(
            f"{where}: pretrained_cfg input_size {input_size!r} is not the model's {expected}"
        )
    interpolation = pretrained.get("interpolation", "bilinear")
    if interpolation not in INTERPOLATIONS:
        raise CheckpointError(
            f"{where}: interpolation {interpolation!r}; served: {', '.join(INTERPOLATIONS)}"
        )
    crop_pct = pretrained.get("crop_pct") or DEFAULT_CROP_PCT
    if (
        not isinstance(crop_pct, int | float)
        or isinstance(crop_pct, bool)
        or not 0.1 <= crop_pct <= 1
    ):
        raise CheckpointError(f"{where}: crop_pct must be in [0.1, 1], got {crop_pct!r}")
    mode = pretrained.get("crop_mode") or "center"
    if mode not in ("center", "squash", "border"):
        raise CheckpointError(f"{where}: crop_mode {mode!r}; timm's are center, squash, border")
    notes = []
    scaled = [math.floor(side / crop_pct) for side in (vit.image_height, vit.image_width)]
    # torchvision's CenterCrop, which timm's transforms end with, rounds its offset half to even.
    geometry: dict = {"crop_offset": "round"}
    if mode == "squash":  # each side scaled to size / crop_pct, then the centre crop
        geometry["resize"] = "resize"
        if scaled != [vit.image_height, vit.image_width]:
            geometry["resize_to"] = scaled
    else:
        geometry.update(resize="resize-crop", shorter_side=max(scaled))
        if mode != "center" or scaled[0] != scaled[1]:
            notes.append(
                f"timm's crop_mode {mode!r} at {vit.image_height}x{vit.image_width} is served as a "
                f"resize of the shorter side to {max(scaled)} and a centre crop"
            )
    channels = vit.in_channels
    return {
        **geometry,
        "resample": interpolation,
        "color": "grayscale" if channels == 1 else "rgb",
        "pad_value": 0,
        "polarity": "natural",
        "scale": 1 / 255,
        # as they are: the contract's Preprocessing refuses what is not a list of numbers
        "mean": pretrained.get("mean", IMAGENET_DEFAULT_MEAN),
        "std": pretrained.get("std", IMAGENET_DEFAULT_STD),
    }, notes
