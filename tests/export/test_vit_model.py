"""The ViT: shapes stage by stage, patch embedding, position tables, attention, pooling, inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from export.config import PRESETS, ViTConfig, get_preset
from export.model import PatchEmbedding, VisionTransformer, WithAttention, sinusoidal_table
from export.summary import format_summary, module_rows, trace_shapes
from tests.export.conftest import small


def with_random_head(model: VisionTransformer) -> VisionTransformer:
    """The head is zero-initialised (all logits 0): give it weights so outputs can differ."""
    nn.init.normal_(model.head.weight, std=0.5)
    nn.init.normal_(model.head.bias, std=0.5)
    return model


# -- the seeds' shape table (vit-hands-on), for every block of every preset --------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_seed_shape_table(name):
    config = get_preset(name)
    batch = 1 if name == "vit-b16" else 3
    torch.manual_seed(0)
    model = VisionTransformer(config)
    images = torch.randn(batch, config.in_channels, config.image_height, config.image_width)
    stages = trace_shapes(model, images)
    shapes = dict(stages)
    assert len(shapes) == len(stages), "stage names must be unique"
    nseq, tokens, d, nh = config.num_patches, config.num_tokens, config.dim, config.heads
    assert nseq == (config.image_height // config.patch_size) * (
        config.image_width // config.patch_size
    )

    # linearProjection: (B, nc, h, w) -> (B, Nseq, d_model)
    assert shapes["input"] == (batch, config.in_channels, config.image_height, config.image_width)
    assert shapes["patch embedding"] == (batch, nseq, d)
    assert ("+ class token" in shapes) == (config.pooling == "token")
    for layer in range(config.depth):
        # attentionBlock: (B, Nseq, d_model) -> (B, Nseq, d_model // nh), one per head
        assert shapes[f"block {layer} per-head output"] == (batch, nh, tokens, d // nh)
        assert shapes[f"block {layer} attention probabilities"] == (batch, nh, tokens, tokens)
        # multiHeadAttentionBlock and encoderBlock: (B, Nseq, d_model) -> (B, Nseq, d_model)
        assert shapes[f"block {layer} multi-head attention (projected)"] == (batch, tokens, d)
        assert shapes[f"block {layer} mlp hidden"] == (batch, tokens, config.mlp_dim)
        assert shapes[f"block {layer} output"] == (batch, tokens, d)
    assert shapes[f"pooled ({config.pooling})"] == (batch, d)
    if config.representation_size is not None:
        assert shapes["pre-logits (Linear + Tanh)"] == (batch, config.representation_size)
    # vit: (B, nc, h, w) -> (B, num_classes)
    assert shapes["logits"] == (batch, config.num_classes)
    assert shapes["attention maps (batch, layers, heads, tokens, tokens)"] == (
        batch,
        config.depth,
        nh,
        tokens,
        tokens,
    )


def test_summary_lists_every_parameter_once():
    model = VisionTransformer(get_preset("mnist-tiny"))
    rows = module_rows(model, max_depth=1)
    assert sum(row.parameters for row in rows if row.depth == 1) == model.num_parameters()
    text = format_summary(model, batch=2)
    assert "total parameters: 115,498" in text
    assert "block 1 attention probabilities" in text and "(2, 2, 2, 197, 197)" in text


def test_summary_shows_a_fixed_position_table_as_a_buffer():
    rows = module_rows(VisionTransformer(small(position_embedding="sinusoidal")))
    (row,) = [row for row in rows if row.name == "position_embedding"]
    assert row.parameters == 0 and "buffer" in row.kind


# -- patch embedding -----------------------------------------------------------------------
def test_conv_patch_embedding_equals_manual_patchify_and_linear():
    config = small(image_height=12, image_width=20, in_channels=3, dim=16)
    embedding = PatchEmbedding(config)
    images = torch.randn(2, 3, 12, 20)
    p, rows, cols = 4, 3, 5
    # (B, C, rows, p, cols, p) -> (B, rows * cols, C * p * p): patches row-major, pixels (c, y, x).
    patches = images.reshape(2, 3, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(2, 15, 48)
    weight = embedding.projection.weight.reshape(16, 48)
    manual = patches @ weight.T + embedding.projection.bias
    torch.testing.assert_close(embedding(images), manual, atol=1e-5, rtol=1e-5)


def seed_001_patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The course exercise's patchify, loops and all: the independent reference."""
    n, c, h, w = images.shape
    rows, cols = h // patch_size, w // patch_size
    patches = torch.zeros(n, rows * cols, c * patch_size * patch_size)
    for index, image in enumerate(images):
        for i in range(rows):
            for j in range(cols):
                patch = image[
                    :, i * patch_size : (i + 1) * patch_size, j * patch_size : (j + 1) * patch_size
                ]
                patches[index, i * cols + j] = patch.flatten()
    return patches


def test_linear_patch_embedding_is_seed_001s_patchify_then_a_linear_layer():
    config = small(image_height=12, image_width=20, in_channels=3, dim=16, patch_embedding="linear")
    embedding = PatchEmbedding(config)
    assert isinstance(embedding.projection, nn.Linear)
    assert embedding.projection.weight.shape == (16, 3 * 4 * 4)
    images = torch.randn(2, 3, 12, 20)
    expected = embedding.projection(seed_001_patchify(images, 4))
    torch.testing.assert_close(embedding(images), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_linear_embedding_equals_the_conv_embedding_with_copied_weights(pooling):
    conv_config = small(image_height=12, image_width=20, in_channels=3, pooling=pooling)
    torch.manual_seed(0)
    conv = with_random_head(VisionTransformer(conv_config)).eval()
    linear = VisionTransformer(conv_config.replace(patch_embedding="linear")).eval()
    state = conv.state_dict()
    weight = state["patch_embedding.projection.weight"]
    assert weight.shape == (32, 3, 4, 4)
    state["patch_embedding.projection.weight"] = weight.reshape(32, -1)  # (dim, C * p * p)
    linear.load_state_dict(state)
    images = torch.randn(3, 3, 12, 20)
    with torch.inference_mode():
        torch.testing.assert_close(
            linear.patch_embedding(images), conv.patch_embedding(images), atol=1e-5, rtol=1e-5
        )
        conv_logits, conv_maps = conv.forward_with_attention(images)
        linear_logits, linear_maps = linear.forward_with_attention(images)
    torch.testing.assert_close(linear_logits, conv_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear_maps, conv_maps, atol=1e-5, rtol=1e-5)
    assert conv_logits.std() > 0.1  # the comparison is between outputs that differ per image


def test_linear_patch_embedding_gets_the_conv_init():
    torch.manual_seed(0)
    weight = VisionTransformer(small(patch_embedding="linear")).patch_embedding.projection.weight
    # trunc-normal with std sqrt(1 / fan_in), fan_in = 1 * 4 * 4 = 16
    assert abs(weight.std().item() - math.sqrt(1 / 16)) < 0.03


@pytest.mark.slow
def test_linear_patch_embedding_exports_to_onnx_and_matches_pytorch():
    from export.onnx import build_graphs, verify

    torch.manual_seed(0)
    model = with_random_head(
        VisionTransformer(small(in_channels=3, patch_embedding="linear", pooling="token"))
    ).eval()
    graphs = build_graphs(model)
    figures = verify(model, graphs, torch.randn(64, 3, 16, 16))
    assert all(row["argmax_mismatches"] == 0 for row in figures.values())
    assert "MatMul" in {node.op_type for node in graphs.classifier.graph.node}
    assert "Conv" not in {node.op_type for node in graphs.classifier.graph.node}


# -- position embeddings -------------------------------------------------------------------
def test_sinusoidal_table_matches_its_formula():
    dim = 16
    table = sinusoidal_table(50, dim)
    assert table.shape == (50, dim) and table.dtype == torch.float32
    for position in (0, 1, 7, 49):
        for i in range(dim // 2):
            angle = position / 10000 ** (2 * i / dim)
            assert table[position, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[position, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_positions_are_fixed_and_not_saved():
    config = small(position_embedding="sinusoidal", pooling="token")
    model = VisionTransformer(config)
    assert "position_embedding" not in dict(model.named_parameters())
    assert "position_embedding" not in model.state_dict()
    assert not model.position_embedding.requires_grad
    torch.testing.assert_close(
        model.position_embedding[0], sinusoidal_table(config.num_tokens, config.dim)
    )
    learned = VisionTransformer(small())
    assert "position_embedding" in dict(learned.named_parameters())
    assert "position_embedding" in learned.state_dict()


# -- attention ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["token", "mean"])
@pytest.mark.parametrize("training", [False, True])
def test_fused_and_explicit_attention_agree(pooling, training, monkeypatch):
    torch.manual_seed(0)
    model = with_random_head(VisionTransformer(small(pooling=pooling))).train(training)
    images = torch.randn(4, 1, 16, 16)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(1) or real_sdpa(*a, **k),
    )
    fused = model(images)
    assert len(calls) == model.config.depth, "the default forward must use the fused kernel"
    model.set_fused_attention(False)
    explicit = model(images)
    assert len(calls) == model.config.depth, "the explicit path must not call the fused kernel"
    model.set_fused_attention(True)
    with_maps, _ = model.forward_with_attention(images)
    assert fused.abs().max() > 0.1
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, with_maps, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_the_exported_projection_is_pytorchs(qkv_bias, monkeypatch):
    """Exported, q, k and v are three products by thirds of the packed weight, the queries'
    scale folded into theirs: the same q (already scaled), k and v as PyTorch's one product."""
    torch.manual_seed(0)
    attention = VisionTransformer(small(qkv_bias=qkv_bias)).blocks[0].attention
    if qkv_bias:
        nn.init.normal_(attention.qkv.bias)
    x = torch.randn(3, 17, 32)
    expected = attention.project(x, query_scale=attention.scale)
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    exported = attention.project(x, query_scale=attention.scale)
    for got, want in zip(exported, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    unscaled_q = attention.project(x)[0]
    torch.testing.assert_close(unscaled_q * attention.scale, exported[0], atol=1e-6, rtol=1e-6)


def test_attention_rows_are_probabilities():
    config = small(pooling="token")
    model = VisionTransformer(config).eval()
    _, maps = model.forward_with_attention(torch.randn(3, 1, 16, 16))
    assert maps.shape == (3, config.depth, config.heads, config.num_tokens, config.num_tokens)
    assert (maps >= 0).all()
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]), atol=1e-5, rtol=0)
    logits, maps2 = WithAttention(model)(torch.randn(3, 1, 16, 16))
    assert logits.shape == (3, 10) and maps2.shape == maps.shape


# -- pooling -----------------------------------------------------------------------------------
def test_token_pooling_reads_only_the_class_token():
    model = VisionTransformer(small(pooling="token", representation_size=8)).eval()
    assert model.class_token is not None and model.config.num_tokens == 17
    features = torch.randn(2, 17, 32)
    others_changed = features.clone()
    others_changed[:, 1:] += 1.0
    token_changed = features.clone()
    token_changed[:, 0] += 1.0
    pooled = model.forward_head(features, pre_logits=True)
    assert pooled.shape == (2, 8)
    torch.testing.assert_close(model.forward_head(others_changed, pre_logits=True), pooled)
    assert not torch.allclose(model.forward_head(token_changed, pre_logits=True), pooled)


def test_mean_pooling_reads_every_token():
    model = VisionTransformer(small(pooling="mean", representation_size=8)).eval()
    assert model.class_token is None and model.config.num_tokens == 16
    features = torch.randn(2, 16, 32)
    changed = features.clone()
    changed[:, 5] += 1.0
    pooled = model.forward_head(features, pre_logits=True)
    torch.testing.assert_close(pooled, model.pre_logits(features.mean(dim=1)))
    assert not torch.allclose(model.forward_head(changed, pre_logits=True), pooled)


def every_token_logits(model: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """The logits as timm and Hugging Face compute a ViT's, written out here: every token through
    every block, attention from the packed qkv, then the model's own heads."""
    x = model.embed(images)
    for block in model.blocks:
        attention, y = block.attention, block.norm1(x)
        batch, tokens, dim = y.shape
        q, k, v = (
            attention.qkv(y)
            .reshape(batch, tokens, 3, attention.heads, attention.head_dim)
            .permute(2, 0, 3, 1, 4)
        )
        weights = (q @ k.transpose(-2, -1) / math.sqrt(attention.head_dim)).softmax(dim=-1)
        x = x + attention.projection((weights @ v).transpose(1, 2).reshape(batch, tokens, dim))
        x = x + block.mlp(block.norm2(x))
    return model.logits(x if model.config.pooled_norm else model.norm(x))


POOLINGS = {
    "class token": {"pooling": "token"},
    "class token, pooled norm": {"pooling": "token", "pooled_norm": True},
    "mean": {"pooling": "mean"},
    "class and distillation heads": {
        "pooling": "token",
        "distillation_token": True,
        "distillation_head": True,
    },
    "distillation token, no head": {
        "pooling": "token",
        "distillation_token": True,
        "distillation_head": False,
    },
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("changes", POOLINGS.values(), ids=POOLINGS.keys())
def test_the_last_block_computes_what_the_heads_read_and_the_logits_are_every_tokens(
    changes, fused
):
    """The last block keeps only the rows the heads read (``read_rows``): the same logits as every
    token through every block, and the last block's MLP sees those rows only."""
    torch.manual_seed(0)
    model = VisionTransformer(small(depth=3, **changes)).eval()
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.2)
    model.set_fused_attention(fused)
    seen = []
    for block in model.blocks:
        block.mlp.register_forward_hook(lambda _m, inputs, _o: seen.append(inputs[0].shape[1]))
    images = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        logits = model(images)
        assert seen == [model.config.num_tokens] * 2 + [model.read_rows or model.config.num_tokens]
        torch.testing.assert_close(logits, every_token_logits(model, images))
        heads = model.forward_heads(images)
        features, _ = model.forward_features(images)
        every_token = (model.forward_head(features), model.forward_distillation_head(features))
        torch.testing.assert_close(heads, every_token)
    expected_rows = {"mean": None, "class and distillation heads": 2}
    name = next(key for key, value in POOLINGS.items() if value == changes)
    assert model.read_rows == expected_rows.get(name, 1)


def test_without_representation_size_the_head_sees_the_pooled_features():
    model = VisionTransformer(small(pooling="mean")).eval()
    features = torch.randn(2, 16, 32)
    torch.testing.assert_close(model.forward_head(features, pre_logits=True), features.mean(dim=1))


# -- inputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels", [1, 3])
def test_one_and_three_channels(channels):
    model = VisionTransformer(small(in_channels=channels)).eval()
    assert model.patch_embedding.projection.in_channels == channels
    assert model(torch.randn(2, channels, 16, 16)).shape == (2, 10)
    other = 4 - channels
    with pytest.raises(
        ValueError, match=rf"expected images of shape \(batch, {channels}, 16, 16\)"
    ):
        model(torch.randn(2, other, 16, 16))


def test_non_square_images():
    config = small(image_height=28, image_width=56, heads=2, pooling="token")
    assert config.grid == (7, 14) and config.num_patches == 98 and config.num_tokens == 99
    model = VisionTransformer(config).eval()
    logits, maps = model.forward_with_attention(torch.randn(2, 1, 28, 56))
    assert logits.shape == (2, 10) and maps.shape == (2, 2, 2, 99, 99)
    with pytest.raises(ValueError, match=r"got \(2, 1, 56, 28\)"):
        model(torch.randn(2, 1, 56, 28))


def test_a_patch_that_does_not_divide_a_side_is_refused():
    with pytest.raises(ValueError, match="patch_size 5 does not divide image_height 28"):
        ViTConfig(patch_size=5)
    with pytest.raises(ValueError, match="patch_size 8 does not divide image_width 28"):
        ViTConfig(image_height=32, image_width=28, patch_size=8)


def test_summary_command_prints_modules_and_shapes(run_module):
    completed = run_module("export.summary", "--preset", "cifar10-small", "--batch", "2")
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "preset cifar10-small" in out and "32x32x3 images, patch 4 -> 8x8 = 64 patches" in out
    assert "+ class token" in out and "(2, 65, 48)" in out
    assert "block 3 per-head output" in out and "(2, 4, 65, 12)" in out
    assert "logits" in out and "(2, 10)" in out
    model = VisionTransformer(get_preset("cifar10-small"))
    assert f"total parameters: {model.num_parameters():,}" in out
    refused = run_module("export.summary", "--preset", "cifar10-small", "--batch", "0")
    assert refused.returncode == 2 and "--batch must be at least 1, got 0" in refused.stderr
