"""A Hugging Face model directory (``save_pretrained``): ``ViTForImageClassification``,
``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher``.

``config.json`` gives the model, ``id2label`` the labels, ``preprocessor_config.json`` the
preprocessing; the weights are read under the names transformers writes to disk
(``vit.encoder.layer.N.attention.attention.query.weight``, ...).
"""

from __future__ import annotations

from pathlib import Path

from export.checkpoint import CheckpointError
from export.config import ViTConfig
from export.importers.labels import Labels, unique_labels
from export.importers.weights import (
    Layout,
    Target,
    bounded_int,
    checked_config,
    read_json,
    sides,
)

# architecture -> (weight prefix, distillation token, distillation head, heads' weight names)
ARCHITECTURES = {
    "ViTForImageClassification": ("vit", False, False, {"classifier": "head"}),
    "DeiTForImageClassification": ("deit", True, False, {"classifier": "head"}),
    "DeiTForImageClassificationWithTeacher": (
        "deit",
        True,
        True,
        {"cls_classifier": "head", "distillation_classifier": "distillation_head"},
    ),
}
# transformers' PIL resampling numbers (PIL.Image.Resampling), by name
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box"}


def architecture(config: dict, where: str) -> str:
    names = config.get("architectures")
    if (
        not isinstance(names, list)
        or len(names) != 1
        or not isinstance(names[0], str)  # a list or an object would not even look up
        or names[0] not in ARCHITECTURES
    ):
        raise CheckpointError(
            f"{where}: architectures {names!r} is not imported; supported: "
            + ", ".join(ARCHITECTURES)
        )
    return names[0]


def vit_config(config: dict, where: str) -> tuple[ViTConfig, Labels]:
    """The ViTConfig and the labels of a transformers ViT or DeiT ``config.json``, checked before
    anything is built; what vitserve's ViT cannot be (another activation) is refused."""
    _, distillation, with_teacher, _ = ARCHITECTURES[architecture(config, where)]
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointError(f"{where}: hidden_act {act!r}; only 'gelu' (exact) is imported")
    height, width = sides(where, "image_size", config.get("image_size", 224), 4096)
    patch = sides(where, "patch_size", config.get("patch_size", 16), 1024)
    if patch[0] != patch[1]:
        raise CheckpointError(
            f"{where}: patch_size {list(patch)}; only square patches are imported"
        )
    labels = labels_of(config, where)
    vit = checked_config(
        where,
        {
            "image_height": height,
            "image_width": width,
            "in_channels": bounded_int(where, "num_channels", config.get("num_channels", 3), 1, 3),
            "patch_size": patch[0],
            "num_classes": len(labels.names),
            "dim": config.get("hidden_size", 768),
            "depth": config.get("num_hidden_layers", 12),
            "heads": config.get("num_attention_heads", 12),
            "mlp_dim": config.get("intermediate_size", 3072),
            "pooling": "token",
            "position_embedding": "learned",
            "patch_embedding": "conv",
            "distillation_token": distillation,
            "distillation_head": with_teacher if distillation else True,
            "qkv_bias": _flag(where, "qkv_bias", config.get("qkv_bias", True)),
            "layer_norm_eps": config.get("layer_norm_eps", 1e-12),
        },
    )
    return vit, labels


def _flag(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def labels_of(config: dict, where: str) -> Labels:
    """``id2label`` in class order, by its keys' numbers (transformers writes the keys sorted as
    text: "0", "1", "10", "11", "2", ...): they must be 0 .. n-1."""
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        raise CheckpointError(f"{where}: no id2label; the labels are needed to serve the model")
    bounded_int(where, "the number of labels", len(id2label), 1, 100_000)
    try:
        by_index = {int(key): value for key, value in id2label.items()}
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: id2label keys must be class numbers") from None
    if sorted(by_index) != list(range(len(by_index))):
        raise CheckpointError(f"{where}: id2label must number the classes 0 to {len(by_index) - 1}")
    names = unique_labels([by_index[i] for i in range(len(by_index))], where)
    return Labels(names, "from the checkpoint's id2label")


def weight_layout(config: ViTConfig, architecture_name: str) -> Layout:
    """Every weight the checkpoint holds, by its name on disk, and where it goes."""
    prefix, _, _, heads = ARCHITECTURES[architecture_name]
    embeddings = f"{prefix}.embeddings"
    layout: Layout = {
        f"{embeddings}.cls_token": Target("class_token"),
        f"{embeddings}.position_embeddings": Target("position_embedding"),
        f"{embeddings}.patch_embeddings.projection.weight": Target(
            "patch_embedding.projection.weight"
        ),
        f"{embeddings}.patch_embeddings.projection.bias": Target("patch_embedding.projection.bias"),
        f"{prefix}.layernorm.weight": Target("norm.weight"),
        f"{prefix}.layernorm.bias": Target("norm.bias"),
    }
    if config.distillation_token:
        layout[f"{embeddings}.distillation_token"] = Target("distillation_token")
    kinds = ("weight", "bias")
    for i in range(config.depth):
        source, block = f"{prefix}.encoder.layer.{i}", f"blocks.{i}"
        for part, name in enumerate(("query", "key", "value")):
            for kind in kinds if config.qkv_bias else ("weight",):
                layout[f"{source}.attention.attention.{name}.{kind}"] = Target(
                    f"{block}.attention.qkv.{kind}", part, 3
                )
        for name, ours in (
            ("attention.output.dense", "attention.projection"),
            ("layernorm_before", "norm1"),
            ("layernorm_after", "norm2"),
            ("intermediate.dense", "mlp.fc1"),
            ("output.dense", "mlp.fc2"),
        ):
            for kind in kinds:
                layout[f"{source}.{name}.{kind}"] = Target(f"{block}.{ours}.{kind}")
    for name, ours in heads.items():
        for kind in kinds:
            layout[f"{name}.{kind}"] = Target(f"{ours}.{kind}")
    return layout


def _size(where: str, name: str, value: object) -> tuple[int, int] | int:
    """A size entry: ``{"height", "width"}``, ``{"shortest_edge"}`` (an int) or a bare int, which
    transformers' ViT and DeiT processors read as a square."""
    if isinstance(value, dict):
        if set(value) == {"height", "width"}:
            return sides(where, name, [value["height"], value["width"]], 8192)
        if set(value) == {"shortest_edge"}:
            return bounded_int(where, f"{name}.shortest_edge", value["shortest_edge"], 1, 8192)
    elif isinstance(value, int) and not isinstance(value, bool):
        return sides(where, name, value, 8192)
    raise CheckpointError(f"{where}: {name} {value!r} is not a size this importer reads")


def preprocessing(processor: dict, config: ViTConfig, where: str) -> tuple[dict, list[str]]:
    """The ``preprocessing`` document from ``preprocessor_config.json``, and notes on what the
    service does differently from the processor (empty when it does the same)."""
    notes = []
    input_size = (config.image_height, config.image_width)
    resample_value = processor.get("resample", 2)
    resample = RESAMPLE.get(resample_value) if isinstance(resample_value, int) else resample_value
    if resample not in RESAMPLE.values():
        raise CheckpointError(
            f"{where}: resample {resample_value!r}; served: "
            + ", ".join(f"{k} ({v})" for k, v in RESAMPLE.items())
        )
    size = _size(where, "size", processor.get("size", {"height": 224, "width": 224}))
    crop = processor.get("do_center_crop", False)
    # Hugging Face's center_crop starts at (h - H) // 2.
    document: dict = {"resample": resample, "crop_offset": "floor"}
    if not processor.get("do_resize", True):
        notes.append(
            "the processor does not resize (do_resize false); the service resizes to the input"
        )
        document["resize"] = "resize"
    elif isinstance(size, int):  # shortest edge
        document.update(resize="resize-crop", shorter_side=size)
        if not crop:
            notes.append(
                f"the processor resizes the shorter side to {size} without a crop; the service crops the centre {input_size}"
            )
    elif crop:
        crop_size = _size(
            where, "crop_size", processor.get("crop_size", {"height": 224, "width": 224})
        )
        if crop_size != input_size:
            raise CheckpointError(
                f"{where}: crop_size {crop_size} is not the model's input {input_size}"
            )
        document["resize"] = "resize"
        if size != crop_size:  # squashed to size, then the centre crop (DeiT: 256 x 256, then 224)
            if size[0] < crop_size[0] or size[1] < crop_size[1]:
                raise CheckpointError(
                    f"{where}: the resize to {size} is smaller than the crop {crop_size}"
                )
            document["resize_to"] = list(size)
    else:
        document["resize"] = "resize"
        if size != input_size:
            notes.append(
                f"the processor resizes to {size}, not the model's input {input_size}; the service resizes to the input"
            )
    if document.get("shorter_side") is not None and document["shorter_side"] < max(input_size):
        raise CheckpointError(
            f"{where}: the resize to {document['shorter_side']} is smaller than the input {input_size}"
        )
    channels = config.in_channels
    scale = processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1.0
    if processor.get("do_normalize", True):
        mean, std = processor.get("image_mean", [0.5] * 3), processor.get("image_std", [0.5] * 3)
    else:
        mean, std = [0.0] * channels, [1.0] * channels
    document.update(
        color="grayscale" if channels == 1 else "rgb",
        pad_value=0,
        polarity="natural",
        scale=scale,
        mean=mean,
        std=std,
    )
    return document, notes


def read_processor(directory: Path) -> dict:
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{directory}: no preprocessor_config.json; save the image processor beside the model "
            "(processor.save_pretrained) so that the service prepares images as it does"
        )
    return read_json(path)
