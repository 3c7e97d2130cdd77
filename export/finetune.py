"""Fine-tuning across datasets: ``--init-from`` a run trained on other images or other classes.

The new model is the parent's (width, depth, heads, patch size, pooling, ...) at the new dataset's
image size, channels and classes, and starts from the parent's weights adapted to them:

- the head (and the pre-logits layer) is initialised afresh when the classes differ;
- the patch embedding takes the new channels: a grey parent's filter is spread over red, green and
  blue (each a third, so a grey image gives the same embedding); a colour parent's filters are
  summed into one grey channel;
- a learned position table is resized to the new patch grid (bilinear), its class and
  distillation tokens' positions kept.

Everything else is copied as it is. The parent may also be a checkpoint imported from Hugging Face
or timm (export/importers/): ``--init-from`` its directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from export.checkpoint import load_checkpoint, resolve_checkpoint
from export.config import ViTConfig
from export.importers import is_imported, load_imported
from export.importers.weights import weight_file
from export.model import VisionTransformer

# The fields that make a model what it is: a fine-tuned model keeps the parent's.
ARCHITECTURE_FIELDS = (
    "patch_size",
    "dim",
    "depth",
    "heads",
    "mlp_dim",
    "pooling",
    "position_embedding",
    "patch_embedding",
    "representation_size",
    "distillation_token",
    "dropout",
    "attention_dropout",
    "qkv_bias",
    "layer_norm_eps",
    "class_token",
    "pooled_norm",
    "distillation_head",
)


def architecture(config: ViTConfig) -> dict:
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def conflicting_fields(parent: ViTConfig, given: dict) -> list[str]:
    """The architecture fields the user gave that differ from the parent's."""
    own = architecture(parent)
    return [
        f"{name} {given[name]} (the parent's is {own[name]})"
        for name in own
        if name in given and given[name] != own[name]
    ]


def parent_weights(init_from: str | Path) -> Path:
    """The file a run starts from (its sha256 is recorded): a vitserve checkpoint, or the weights
    file of an imported checkpoint's directory."""
    if is_imported(init_from):
        return weight_file(Path(init_from))
    return resolve_checkpoint(init_from)


def load_parent(weights: Path) -> tuple[VisionTransformer, dict[str, str]]:
    """The parent model and its metadata (``dataset``, ``labels``) from ``parent_weights``' file;
    an imported parent's dataset is its source, which no dataset of ours is named."""
    if is_imported(weights.parent):
        imported = load_imported(weights.parent)
        source = f"{imported.library} {imported.architecture} ({weights.parent})"
        return imported.model, {"dataset": source, "labels": json.dumps(imported.labels)}
    return load_checkpoint(weights)


def adapt_patch_weight(weight: torch.Tensor, channels: int, config: ViTConfig) -> torch.Tensor:
    """A conv (dim, C, p, p) or linear (dim, C * p * p) patch weight for ``channels`` channels."""
    p = config.patch_size
    conv = weight.reshape(weight.shape[0], -1, p, p)
    if conv.shape[1] != channels:
        if channels == 1:
            conv = conv.sum(dim=1, keepdim=True)
        else:
            conv = conv.sum(dim=1, keepdim=True).expand(-1, channels, -1, -1) / channels
    return conv.reshape(weight.shape[0], -1) if weight.ndim == 2 else conv.contiguous()


def resize_positions(table: torch.Tensor, old: ViTConfig, new: ViTConfig) -> torch.Tensor:
    """A learned (1, tokens, dim) table for ``new``'s grid; the leading class and distillation
    tokens' positions are kept as they are."""
    extra = old.num_prefix_tokens
    head, grid = table[:, :extra], table[:, extra:]
    rows, cols = old.grid
    grid = grid.reshape(1, rows, cols, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new.grid, mode="bilinear", align_corners=False)
    return torch.cat([head, grid.permute(0, 2, 3, 1).reshape(1, new.num_patches, -1)], dim=1)


def adapt(parent: VisionTransformer, model: VisionTransformer, same_classes: bool) -> list[str]:
    """Loads ``parent``'s weights into ``model`` (same architecture, other data); returns what was
    adapted, in words."""
    old, new = parent.config, model.config
    state = dict(parent.state_dict())
    done = []
    name = "patch_embedding.projection.weight"
    if old.in_channels != new.in_channels:
        state[name] = adapt_patch_weight(state[name], new.in_channels, old)
        done.append(f"patch embedding {old.in_channels} -> {new.in_channels} channel(s)")
    if "position_embedding" in state and old.grid != new.grid:
        state["position_embedding"] = resize_positions(state["position_embedding"], old, new)
        done.append(f"position table {old.grid} -> {new.grid} patches")
    if not same_classes:
        fresh = model.state_dict()
        for key in fresh:
            if key.startswith(("head.", "distillation_head.", "pre_logits.")):
                state[key] = fresh[key]
        done.append(f"head initialised afresh for {new.num_classes} classes")
    model.load_state_dict(state)
    return done
