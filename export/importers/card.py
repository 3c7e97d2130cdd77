"""MODEL_CARD.md for a model imported from another library: where it came from, its config, how
the service prepares its images, and how its graphs matched PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

from export.importers import Imported

# Long lists that say nothing about the model: the labels are in labels.txt.
LEFT_OUT = ("id2label", "label2id", "label_names", "label_descriptions")
LIBRARIES = {"transformers": "Hugging Face transformers", "timm": "timm"}


def render(imported: Imported, source_dir: Path, name: str, version: int, figures: dict) -> str:
    model = imported.model
    config = {k: v for k, v in imported.config.items() if k not in LEFT_OUT}
    worst_logits = max(row["logits_max_abs_diff"] for row in figures.values())
    worst_maps = max(row["attention_max_abs_diff"] for row in figures.values())
    pre = imported.preprocessing
    size = f"{model.config.image_height}x{model.config.image_width}"
    resize_to = pre.get("resize_to")
    geometry = {
        "resize": f"resize to {resize_to[0]}x{resize_to[1]}, then crop the centre {size}"
        if resize_to
        else f"resize to {size}",
        "resize-crop": f"resize the shorter side to {pre.get('shorter_side')}, then crop the "
        f"centre {model.config.image_height}x{model.config.image_width}",
        "fit-pad": "fit inside the input and pad",
    }[pre["resize"]]
    lines = [
        f"# Model card: {name}, version {version}",
        "",
        f"Imported from a {LIBRARIES[imported.library]} checkpoint (`{imported.architecture}`) by "
        f"`python -m export.onnx {source_dir} --name {name} --version {version}`; vitserve did not "
        "train it and has measured no accuracy for it.",
        "",
        "## Source",
        "",
        f"- Library: {LIBRARIES[imported.library]}; architecture `{imported.architecture}`.",
        f"- Weights: `{imported.weights.name}`, sha256 `{imported.weights_sha256}`.",
        f"- {len(imported.labels)} classes (labels.txt); labels {imported.labels_source}.",
        f"- As vitserve's ViT, {model.num_parameters():,} parameters: "
        f"`{json.dumps(model.config.description(), sort_keys=True)}`.",
        "",
        "## Preprocessing (from the checkpoint's own config)",
        "",
        f"- {geometry}, {pre['resample']} resampling; scale {pre['scale']:.6g}, mean "
        f"{pre['mean']}, std {pre['std']}.",
        *(f"- Differs from the source: {note}." for note in imported.notes),
        "",
        "## Verification",
        "",
        f"- Both graphs against PyTorch on seeded images at batch sizes "
        f"{', '.join(key.removeprefix('batch_') for key in figures)}: logits within "
        f"{worst_logits:.2g}, attention maps within {worst_maps:.2g} (max abs difference).",
        "",
        "## The source's config",
        "",
        "```json",
        json.dumps(config, indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)
