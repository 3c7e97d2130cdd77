"""Attention maps per patch: rollout through all layers, and the last layer's heads.

Works on the ``attention`` tensor a ViT returns (``forward_with_attention`` or ``attention.onnx``):
shape (batch, layers, heads, tokens, tokens), rows are softmax probabilities. NumPy only, so that
anything holding those maps (the report, the service) can turn them into images.
"""

from __future__ import annotations

import numpy as np


def _check(attention: np.ndarray, pooling: str) -> np.ndarray:
    attention = np.asarray(attention, dtype=np.float64)
    if attention.ndim != 5 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(
            "attention must have shape (batch, layers, heads, tokens, tokens), "
            f"got {attention.shape}"
        )
    if pooling not in ("token", "mean"):
        raise ValueError(f"pooling must be 'token' or 'mean', got {pooling!r}")
    return attention


def _pool_rows(matrix: np.ndarray, pooling: str) -> np.ndarray:
    """(batch, [heads,] tokens, tokens) -> relevance of each patch, (batch, [heads,] patches).

    With a class token the classifier reads row 0 (what the class token attends to), without the
    class token's own column; with mean pooling it reads every row equally.
    """
    if pooling == "token":
        return matrix[..., 0, 1:]
    return matrix.mean(axis=-2)


def attention_rollout(attention: np.ndarray, pooling: str) -> np.ndarray:
    """Attention rollout (Abnar and Zuidema, 2020), one relevance per patch: (batch, patches).

    For each layer: average the heads, add the identity (the residual path), renormalise the rows;
    then multiply the layers together, the last layer on the left.
    """
    attention = _check(attention, pooling)
    batch, layers, _, tokens, _ = attention.shape
    identity = np.eye(tokens)
    rollout = np.broadcast_to(identity, (batch, tokens, tokens))
    for layer in range(layers):
        joint = attention[:, layer].mean(axis=1) + identity
        joint = joint / joint.sum(axis=-1, keepdims=True)
        rollout = joint @ rollout
    return _pool_rows(rollout, pooling)


def last_layer_heads(attention: np.ndarray, pooling: str) -> np.ndarray:
    """Each head of the last layer, pooled like the classifier pools tokens: (batch, heads, patches)."""
    attention = _check(attention, pooling)
    return _pool_rows(attention[:, -1], pooling)


def to_grid(relevance: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(..., patches) -> (..., grid_h, grid_w), in the row-major order the patch embedding uses."""
    rows, cols = grid
    if relevance.shape[-1] != rows * cols:
        raise ValueError(f"{relevance.shape[-1]} patches do not fill a {rows}x{cols} grid")
    return relevance.reshape(*relevance.shape[:-1], rows, cols)


def normalise_maps(maps: np.ndarray) -> np.ndarray:
    """Scale each map (the last two axes) to [0, 1] for display; a constant map becomes zeros."""
    low = maps.min(axis=(-2, -1), keepdims=True)
    span = maps.max(axis=(-2, -1), keepdims=True) - low
    return np.where(span > 0, (maps - low) / np.where(span > 0, span, 1.0), 0.0)
