"""Attention maps (rollout and raw heads), written once in service/contract/attention_maps.py and used by the
service and the export's report; checked here against the recipe written out independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.model import VisionTransformer
from service.contract.attention_maps import attention_map, normalise, rollout


# -- the independent reference: batches, (batch, layers, heads, tokens, tokens) -----------------
def reference_joint(attention: np.ndarray) -> np.ndarray:
    """The recipe written out for one image at a time: (batch, tokens, tokens)."""
    out = []
    for image in attention:
        tokens = image.shape[-1]
        result = np.eye(tokens)
        for layer in image:
            joint = layer.mean(axis=0) + np.eye(tokens)
            joint /= joint.sum(axis=1, keepdims=True)
            result = joint @ result
        out.append(result)
    return np.stack(out)


def pool_rows(matrix: np.ndarray, pooling: str) -> np.ndarray:
    """The class token's row without its own column, or the mean of all rows."""
    return matrix[..., 0, 1:] if pooling == "token" else matrix.mean(axis=-2)


def attention_rollout(attention: np.ndarray, pooling: str) -> np.ndarray:
    """(batch, patches): rollout through every layer given."""
    return pool_rows(reference_joint(attention), pooling)


def last_layer_heads(attention: np.ndarray, pooling: str) -> np.ndarray:
    """(batch, heads, patches)."""
    return pool_rows(attention[:, -1], pooling)


def to_grid(relevance: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    return relevance.reshape(*relevance.shape[:-1], *grid)


def normalise_maps(maps: np.ndarray) -> np.ndarray:
    """Each map (last two axes) min-max scaled to [0, 1]; a constant one becomes zeros."""
    low = maps.min(axis=(-2, -1), keepdims=True)
    span = maps.max(axis=(-2, -1), keepdims=True) - low
    return np.where(span > 0, (maps - low) / np.where(span > 0, span, 1.0), 0.0)


def random_attention(batch=2, layers=3, heads=4, tokens=5, seed=0) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(batch, layers, heads, tokens, tokens))
    weights = np.exp(logits)
    return weights / weights.sum(axis=-1, keepdims=True)


def service_map(attention, method, layer, head, pooling, grid):
    return np.stack(
        [
            attention_map(image, method=method, layer=layer, head=head, pooling=pooling, grid=grid)
            for image in attention
        ]
    )


# -- the service's implementation against the reference ----------------------------------------
@pytest.mark.parametrize(("pooling", "tokens", "grid"), [("token", 7, (2, 3)), ("mean", 6, (3, 2))])
def test_rollout_through_each_layer_matches_the_reference(pooling, tokens, grid):
    attention = random_attention(layers=3, tokens=tokens)
    for layer in range(3):
        expected = normalise_maps(
            to_grid(attention_rollout(attention[:, : layer + 1], pooling), grid)
        )
        got = service_map(attention, "rollout", layer, None, pooling, grid)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_the_joint_attention_is_the_product_of_the_layers():
    attention = random_attention(batch=1, layers=3, tokens=5)
    np.testing.assert_allclose(rollout(attention[0], 2), reference_joint(attention)[0], rtol=1e-12)
    np.testing.assert_allclose(rollout(attention[0], 2).sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_raw_maps_per_head_and_head_mean_match_the_reference(pooling):
    attention = random_attention(layers=2, heads=3, tokens=5)
    grid = (2, 2) if pooling == "token" else (1, 5)
    heads = last_layer_heads(attention, pooling)
    for head in range(3):
        got = service_map(attention, "raw", 1, head, pooling, grid)
        np.testing.assert_allclose(got, normalise_maps(to_grid(heads[:, head], grid)), atol=1e-12)
    mean = pool_rows(attention[:, 0].mean(axis=1), pooling)
    got = service_map(attention, "raw", 0, None, pooling, grid)
    np.testing.assert_allclose(got, normalise_maps(to_grid(mean, grid)), atol=1e-12)


def test_rollout_follows_attention_to_one_patch():
    tokens, target = 5, 3
    attention = np.full((1, 2, 2, tokens, tokens), 0.1 / (tokens - 1))
    attention[..., target] = 0.9  # every token, every head, every layer looks at token 3
    for pooling, grid, patch in (("token", (2, 2), target - 1), ("mean", (1, 5), target)):
        heatmap = service_map(attention, "rollout", 1, None, pooling, grid)[0]
        assert int(np.argmax(heatmap)) == patch and heatmap.max() == 1.0


def test_identity_attention_gives_a_constant_map_which_becomes_zeros():
    attention = np.broadcast_to(np.eye(5), (1, 3, 2, 5, 5)).copy()
    np.testing.assert_array_equal(attention_rollout(attention, "mean"), np.full((1, 5), 0.2))
    for pooling, grid in (("token", (2, 2)), ("mean", (1, 5))):
        np.testing.assert_array_equal(service_map(attention, "rollout", 2, None, pooling, grid), 0)


def test_rollout_of_a_real_model_maps_onto_its_patch_grid(tiny_config):
    model = VisionTransformer(tiny_config.replace(image_width=56)).eval()  # 4 x 8 patches
    with torch.inference_mode():
        _, attention = model.forward_with_attention(torch.randn(2, 1, 28, 56))
    attention = attention.numpy()
    grid = model.config.grid
    maps = service_map(attention, "rollout", model.config.depth - 1, None, "token", grid)
    assert maps.shape == (2, 4, 8)
    assert maps.min() == 0.0 and maps.max() == 1.0
    relevance = attention_rollout(attention.astype(np.float64), "token")
    np.testing.assert_allclose(maps, normalise_maps(to_grid(relevance, grid)), atol=1e-9)
    # Row-major, like the patch embedding: patch 8 is the first of the second row.
    one_hot = np.zeros((1, 1, 1, 33, 33))
    one_hot[..., 0, 1 + 8] = 1.0
    assert service_map(one_hot, "raw", 0, 0, "token", grid)[0, 1, 0] == 1.0


def test_normalise_scales_to_zero_one_and_a_constant_map_to_zeros():
    np.testing.assert_array_equal(normalise(np.full((2, 2), 7.0)), 0.0)
    np.testing.assert_allclose(
        normalise(np.array([[1.0, 2.0], [3.0, 5.0]])), [[0.0, 0.25], [0.5, 1.0]]
    )
