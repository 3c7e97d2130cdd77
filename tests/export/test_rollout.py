"""Attention rollout and per-head maps, from the attention tensor a ViT returns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.model import VisionTransformer
from export.rollout import attention_rollout, last_layer_heads, normalise_maps, to_grid


def random_attention(batch=2, layers=3, heads=4, tokens=5, seed=0) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(batch, layers, heads, tokens, tokens))
    weights = np.exp(logits)
    return weights / weights.sum(axis=-1, keepdims=True)


def reference_rollout(attention: np.ndarray) -> np.ndarray:
    """The recipe written out for one image at a time: (tokens, tokens) per image."""
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


def test_rollout_with_a_class_token_reads_its_row_without_its_own_column():
    attention = random_attention()
    full = reference_rollout(attention)
    rollout = attention_rollout(attention, "token")
    assert rollout.shape == (2, 4)
    np.testing.assert_allclose(rollout, full[:, 0, 1:], rtol=1e-12)
    np.testing.assert_allclose(rollout.sum(axis=1), 1 - full[:, 0, 0], rtol=1e-12)


def test_rollout_with_mean_pooling_averages_all_rows():
    attention = random_attention(tokens=6)
    rollout = attention_rollout(attention, "mean")
    assert rollout.shape == (2, 6)
    np.testing.assert_allclose(rollout, reference_rollout(attention).mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(rollout.sum(axis=1), 1.0, rtol=1e-12)  # rows stay distributions


def test_rollout_follows_attention_to_one_patch():
    tokens, target = 5, 3
    attention = np.full((1, 2, 2, tokens, tokens), 0.1 / (tokens - 1))
    attention[..., target] = 0.9  # every token, every head, every layer looks at patch 3
    for pooling in ("token", "mean"):
        relevance = attention_rollout(attention, pooling)[0]
        patches = relevance if pooling == "mean" else np.concatenate([[0.0], relevance])
        assert int(np.argmax(patches)) == target


def test_identity_attention_gives_nothing_to_the_class_token_and_uniform_mean():
    attention = np.broadcast_to(np.eye(5), (1, 3, 2, 5, 5)).copy()
    np.testing.assert_allclose(attention_rollout(attention, "token"), np.zeros((1, 4)))
    np.testing.assert_allclose(attention_rollout(attention, "mean"), np.full((1, 5), 0.2))


def test_last_layer_heads_pool_like_the_classifier():
    attention = random_attention(layers=2, heads=3, tokens=5)
    heads = last_layer_heads(attention, "token")
    assert heads.shape == (2, 3, 4)
    np.testing.assert_allclose(heads, attention[:, -1, :, 0, 1:])
    np.testing.assert_allclose(last_layer_heads(attention, "mean"), attention[:, -1].mean(axis=-2))


def test_rollout_of_a_real_model_maps_onto_its_patch_grid(tiny_config):
    model = VisionTransformer(tiny_config.replace(image_width=56)).eval()  # 4 x 8 patches
    with torch.inference_mode():
        _, attention = model.forward_with_attention(torch.randn(2, 1, 28, 56))
    grid = to_grid(attention_rollout(attention.numpy(), "token"), model.config.grid)
    assert grid.shape == (2, 4, 8)
    maps = normalise_maps(grid)
    assert maps.min() == 0.0 and maps.max() == 1.0
    assert to_grid(np.arange(6.0), (2, 3))[1, 0] == 3.0  # row-major, like the patch embedding


def test_shapes_and_pooling_are_checked():
    with pytest.raises(
        ValueError, match=r"\(batch, layers, heads, tokens, tokens\), got \(2, 5, 5\)"
    ):
        attention_rollout(np.ones((2, 5, 5)), "token")
    with pytest.raises(ValueError, match="pooling must be 'token' or 'mean', got 'avg'"):
        last_layer_heads(random_attention(), "avg")
    with pytest.raises(ValueError, match="5 patches do not fill a 2x3 grid"):
        to_grid(np.ones((1, 5)), (2, 3))


def test_constant_maps_normalise_to_zero():
    maps = np.stack([np.full((2, 2), 7.0), np.array([[1.0, 2.0], [3.0, 5.0]])])
    out = normalise_maps(maps)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], [[0.0, 0.25], [0.5, 1.0]])
