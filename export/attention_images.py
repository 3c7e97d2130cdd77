"""Attention images for every layer and head, and the rollout, from a trained model.

The maps and overlays are the service's own (``service.contract.attention_maps``: the one rollout, the one
colormap), so a picture here is the picture ``/attention`` would return for the same image. The
service is imported where a map is made, so the rest of the export stage runs without it. For each
image, ``write_attention_dir`` writes::

    DIR/<nn>_<true label>/image.png              the model's view of the image (fit-padded)
    DIR/<nn>_<true label>/layer<L>_head<H>.png   one head's attention, L and H from 1
    DIR/<nn>_<true label>/rollout_layer<L>.png   rollout through layers 1..L
    DIR/<nn>_<true label>/tile.png               all of the above: a row per layer
    DIR/index.json                               which image, its true and predicted label
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from export.data import DatasetSpec, Split, normalize
from export.model import VisionTransformer

CELL = 96  # pixels a side of one map in a tile
HEADER = 14


def pick_indices(labels: torch.Tensor, count: int) -> list[int]:
    """The first image of each class in class order, then the next images, ``count`` in all."""
    chosen: list[int] = []
    for label in range(int(labels.max()) + 1 if len(labels) else 0):
        hits = (labels == label).nonzero()
        if len(hits) and len(chosen) < count:
            chosen.append(int(hits[0]))
    for index in range(len(labels)):
        if len(chosen) >= count:
            break
        if index not in chosen:
            chosen.append(index)
    return chosen


@torch.inference_mode()
def attention_of(
    model: VisionTransformer, images: torch.Tensor, spec: DatasetSpec
) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class per image, attention (batch, layers, heads, tokens, tokens)) in eval mode."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        logits, attention = model.forward_with_attention(normalize(images, spec).to(device))
    finally:
        model.train(was_training)
    return logits.argmax(dim=1).cpu().numpy(), attention.float().cpu().numpy()


def image_maps(attention: np.ndarray, model: VisionTransformer) -> dict[str, np.ndarray]:
    """Every head of every layer and the rollout through each layer, as grid maps in [0, 1]."""
    from service.contract.attention_maps import attention_map

    c = model.config
    maps = {}
    for layer in range(c.depth):
        common = {"layer": layer, "pooling": c.pooling, "grid": c.grid}
        maps[f"rollout_layer{layer + 1}"] = attention_map(
            attention, method="rollout", head=None, **common
        )
        for head in range(c.heads):
            maps[f"layer{layer + 1}_head{head + 1}"] = attention_map(
                attention, method="raw", head=head, **common
            )
    return maps


def _cell(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB").resize((CELL, CELL), Image.Resampling.NEAREST)


def attention_tile(
    display: np.ndarray, overlays: dict[str, bytes], depth: int, heads: int
) -> np.ndarray:
    """uint8 (H, W, 3): a row per layer, columns image | rollout through it | head 1..heads."""
    columns = 2 + heads
    tile = Image.new("RGB", (columns * CELL, HEADER + depth * (CELL + HEADER)), "white")
    draw = ImageDraw.Draw(tile)
    view = Image.fromarray(display[..., 0] if display.shape[2] == 1 else display).convert("RGB")
    view = view.resize((CELL, CELL), Image.Resampling.NEAREST)
    titles = ["image", "rollout", *(f"head {h + 1}" for h in range(heads))]
    for column, title in enumerate(titles):
        draw.text((column * CELL + 3, 1), title, fill="black")
    for layer in range(depth):
        top = HEADER + layer * (CELL + HEADER)
        draw.text((3, top + 1), f"layer {layer + 1}", fill="black")
        cells = [view, _cell(overlays[f"rollout_layer{layer + 1}"])]
        cells += [_cell(overlays[f"layer{layer + 1}_head{h + 1}"]) for h in range(heads)]
        for column, cell in enumerate(cells):
            tile.paste(cell, (column * CELL, top + HEADER))
    return np.asarray(tile)


def attention_pictures(
    model: VisionTransformer, split: Split, indices: list[int], spec: DatasetSpec
) -> list[dict]:
    """Per image: its index, labels, display, the overlay PNGs by name and the tile."""
    from service.contract.attention_maps import overlay_png

    images = split.images[indices]
    predicted, attention = attention_of(model, images, spec)
    c = model.config
    pictures = []
    for row, index in enumerate(indices):
        display = images[row].permute(1, 2, 0).numpy()
        overlays = {
            name: overlay_png(display, heat)
            for name, heat in image_maps(attention[row], model).items()
        }
        pictures.append(
            {
                "index": index,
                "true": spec.labels[int(split.labels[index])],
                "predicted": spec.labels[int(predicted[row])],
                "display": display,
                "overlays": overlays,
                "tile": attention_tile(display, overlays, c.depth, c.heads),
            }
        )
    return pictures


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "class"


def write_attention_dir(
    model: VisionTransformer, split: Split, indices: list[int], spec: DatasetSpec, directory: Path
) -> list[Path]:
    """Writes the folder described in the module docstring; returns the image folders."""
    directory.mkdir(parents=True, exist_ok=True)
    folders, index = [], []
    for number, picture in enumerate(attention_pictures(model, split, indices, spec)):
        folder = directory / f"{number:02d}_{_safe(picture['true'])}"
        folder.mkdir(exist_ok=True)
        display = picture["display"]
        Image.fromarray(display[..., 0] if display.shape[2] == 1 else display).save(
            folder / "image.png"
        )
        for name, png in picture["overlays"].items():
            (folder / f"{name}.png").write_bytes(png)
        Image.fromarray(picture["tile"]).save(folder / "tile.png")
        folders.append(folder)
        index.append(
            {
                "folder": folder.name,
                "split_index": picture["index"],
                "true": picture["true"],
                "predicted": picture["predicted"],
            }
        )
    (directory / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folders
