"""Attention maps over the patch grid, and a heatmap overlay a person can look at.

``rollout`` (Abnar & Zuidema 2020): per layer, the head-mean attention plus the identity (the residual
path), rows renormalised to sum to 1, multiplied from the first layer up to the chosen one. ``raw``: one
layer's attention, one head or the mean of the heads. Either way the map is read out for what the
classifier pools: the class token's row when ``pooling`` is ``token`` (class token column dropped), the
mean over all token rows when ``pooling`` is ``mean``. The map is then min-max scaled to [0, 1] (a
constant map becomes all zeros).
"""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
from PIL import Image

Method = Literal["rollout", "raw"]

# Anchors of matplotlib's "inferno" colormap (perceptually uniform), interpolated linearly.
_INFERNO = np.array(
    [
        [0, 0, 4],
        [40, 11, 84],
        [101, 21, 110],
        [159, 42, 99],
        [212, 72, 66],
        [245, 125, 21],
        [250, 193, 39],
        [252, 255, 164],
    ],
    dtype=np.float32,
)

MIN_OVERLAY_SIDE = 224


def rollout(attention: np.ndarray, last_layer: int) -> np.ndarray:
    """Joint attention ``[tokens, tokens]`` through layers ``0..last_layer`` of ``[layers, heads, T, T]``."""
    tokens = attention.shape[-1]
    identity = np.eye(tokens, dtype=np.float64)
    joint = identity
    for layer in range(last_layer + 1):
        fused = attention[layer].astype(np.float64).mean(axis=0) + identity
        fused /= fused.sum(axis=-1, keepdims=True)
        joint = fused @ joint
    return joint


def pooled_map(matrix: np.ndarray, pooling: str) -> np.ndarray:
    """What the pooled representation attends to, one value per patch."""
    if pooling == "token":
        return matrix[0, 1:]
    return matrix.mean(axis=0)


def normalise(values: np.ndarray) -> np.ndarray:
    low, high = float(values.min()), float(values.max())
    if high - low <= 1e-12:
        return np.zeros_like(values, dtype=np.float64)
    return (values - low) / (high - low)


def attention_map(
    attention: np.ndarray,
    *,
    method: Method,
    layer: int,
    head: int | None,
    pooling: str,
    grid: tuple[int, int],
) -> np.ndarray:
    """A ``grid``-shaped map in [0, 1] from one image's attention ``[layers, heads, T, T]``."""
    if method == "rollout":
        matrix = rollout(attention, layer)
    else:
        per_layer = attention[layer].astype(np.float64)
        matrix = per_layer.mean(axis=0) if head is None else per_layer[head]
    return normalise(pooled_map(matrix, pooling)).reshape(grid)


def colorize(values: np.ndarray) -> np.ndarray:
    """[0, 1] values -> uint8 RGB through the inferno colormap."""
    positions = np.clip(values, 0.0, 1.0) * (len(_INFERNO) - 1)
    low = np.floor(positions).astype(np.int64)
    high = np.minimum(low + 1, len(_INFERNO) - 1)
    fraction = (positions - low)[..., None]
    colors = _INFERNO[low] * (1.0 - fraction) + _INFERNO[high] * fraction
    return np.rint(colors).astype(np.uint8)


def overlay_png(display: np.ndarray, heatmap: np.ndarray, alpha: float = 0.5) -> bytes:
    """The model's view of the image with the map over it, upscaled to at least 224 pixels a side."""
    height, width = display.shape[:2]
    factor = max(1, -(-MIN_OVERLAY_SIDE // min(height, width)))
    size = (width * factor, height * factor)
    base = Image.fromarray(display[..., 0] if display.shape[2] == 1 else display)
    base = np.asarray(base.convert("RGB").resize(size, Image.Resampling.NEAREST), dtype=np.float32)
    heat = Image.fromarray(heatmap.astype(np.float32)).resize(size, Image.Resampling.BILINEAR)
    colors = colorize(np.asarray(heat, dtype=np.float32)).astype(np.float32)
    blended = np.rint(base * (1.0 - alpha) + colors * alpha).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blended).save(buffer, format="PNG")
    return buffer.getvalue()
