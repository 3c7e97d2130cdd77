"""A Vision Transformer: conv or linear patch embedding, pre-norm encoder, token or mean pooling,
and optionally DeiT's distillation token.

Attention runs fused (``scaled_dot_product_attention``) unless the caller asks for the attention
probabilities, in which case the same weights run through the explicit ``softmax(q k^T / sqrt(d))``.

The tokens are ``[class token] [distillation token] patches``. The class head reads the class token
(token pooling) or the mean of the patches (mean pooling, where a class token, if there is one, only
takes part in attention); the distillation head, when there is a distillation token, reads that
token and is trained against a teacher (export/teacher.py). The logits are the mean of the two
heads', so the model, and its exported graph, has one output. The final layer norm applies to every
token, or (``pooled_norm``) to what each head reads. With token pooling the last block computes the
rows the heads read only (``read_rows``; every token still serves as a key and a value): the same
logits for about 1/depth less work (docs/decisions.md#last-block-rows).

Checkpoints imported from Hugging Face and timm (export/importers/) are mapped onto this model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from export.config import ViTConfig


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(pos / 10000^(2i/dim))."""
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)
    inverse_frequency = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim)
    )
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inverse_frequency)
    table[:, 1::2] = torch.cos(position * inverse_frequency)
    return table.float()


class PatchEmbedding(nn.Module):
    """Cuts the image into non-overlapping patches and projects each to ``dim``.

    ``conv``: a Conv2d with kernel = stride = patch size. ``linear`` (seed 001's manual patchify):
    reshape into (batch, patches, channels * patch * patch), then a Linear. Both flatten a patch in
    (channel, row, column) order and number patches row by row, so a conv weight reshaped to
    (dim, channels * patch * patch) is the Linear weight of the same function.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        if config.patch_embedding == "linear":
            self.projection = nn.Linear(config.in_channels * p * p, config.dim)
        else:
            self.projection = nn.Conv2d(config.in_channels, config.dim, kernel_size=p, stride=p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.config
        if images.ndim != 4 or images.shape[1:] != (c.in_channels, c.image_height, c.image_width):
            raise ValueError(
                f"expected images of shape (batch, {c.in_channels}, {c.image_height}, {c.image_width}), "
                f"got {tuple(images.shape)}"
            )
        if c.patch_embedding == "linear":
            return self.projection(patchify(images, c.patch_size))  # (B, patches, dim)
        return self.projection(images).flatten(2).transpose(1, 2)  # (B, patches, dim)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, patches, C * p * p), patches row by row; one reshape, no Python loop
    (seed 001 looped over every image and patch)."""
    batch, channels, height, width = images.shape
    p = patch_size
    grid = images.reshape(batch, channels, height // p, p, width // p, p)
    # (B, rows, cols, C, p, p): each patch's values in (channel, row, column) order.
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * p * p)


class Attention(nn.Module):
    def __init__(self, config: ViTConfig, fused: bool = True) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.fused = fused and hasattr(F, "scaled_dot_product_attention")
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.qkv_bias)
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.projection = nn.Linear(config.dim, config.dim)
        self.projection_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, return_attention: bool = False, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every token attends to every token; with ``rows``, only the first ``rows`` tokens ask
        (queries of those only, keys and values of all): (B, rows, dim) out."""
        batch, _, dim = x.shape
        probabilities = None
        if self.fused and not return_attention:
            q, k, v = self.project(x, rows=rows)  # each (B, heads, tokens, head_dim)
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attention_dropout.p if self.training else 0.0
            )
        else:
            # Scale before the softmax (seed 004 scaled after it, which is a different model).
            q, k, v = self.project(x, query_scale=self.scale, rows=rows)
            probabilities = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            out = self.attention_dropout(probabilities) @ v
        out = out.transpose(1, 2).reshape(batch, q.shape[2], dim)
        return self.projection_dropout(self.projection(out)), probabilities

    def project(
        self, x: torch.Tensor, query_scale: float = 1.0, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries times ``query_scale`` (of the first ``rows`` tokens, or all), keys and values,
        each (B, heads, tokens, head_dim), from the packed ``qkv``.

        In PyTorch, one matrix product cut into three views. Exported to ONNX, three products by
        thirds of the packed weight (onnxruntime folds the slices of the initializer when it loads
        the graph): cutting the product's output would be a Split and three Squeeze nodes copying
        every token's q, k and v. The queries' scale goes into their third of the weight and bias,
        folded the same way, so that the attention scores are a plain MatMul: onnxruntime fuses a
        scaled product into a FusedMatMul that ran slower than MatMul on this CPU. Scaling a weight
        by 1/8 (head_dim 64) is exact (docs/decisions.md#onnx-graph-for-onnxruntime).
        """
        batch, tokens, dim = x.shape
        if not torch.onnx.is_in_onnx_export():
            qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            q = q if rows is None else q[:, :, :rows]
            return (q if query_scale == 1.0 else q * query_scale), k, v
        weight, bias = self.qkv.weight, self.qkv.bias
        projections = []
        for i, scale in enumerate((query_scale, 1.0, 1.0)):
            third = slice(i * dim, (i + 1) * dim)  # a Slice node; chunk would be a Split
            w, b = weight[third], None if bias is None else bias[third]
            if scale != 1.0:
                w, b = w * scale, None if b is None else b * scale
            asking = x if i or rows is None else x[:, :rows]
            y = F.linear(asking, w, b).reshape(batch, asking.shape[1], self.heads, self.head_dim)
            projections.append(y.transpose(1, 2))
        q, k, v = projections
        return q, k, v


class GELU(nn.Module):
    """Exact GELU: ``F.gelu`` in PyTorch; exported to ONNX, the erf formula in the order
    onnxruntime fuses (with fc1's bias, into one BiasGelu node). The exporter's own spelling,
    ``x * (0.5 * (1 + erf(x / sqrt(2))))``, is not a pattern onnxruntime matches, and stayed five
    nodes (docs/decisions.md#onnx-graph-for-onnxruntime)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        return F.gelu(x)


class MLP(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_dim)
        self.activation = GELU()
        self.fc2 = nn.Linear(config.mlp_dim, config.dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.activation(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.attention = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, return_attention: bool = False, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, tokens, dim) -> the same; with ``rows``, the first ``rows`` tokens only (the others
        still serve as keys and values)."""
        attended, probabilities = self.attention(self.norm1(x), return_attention, rows)
        x = (x if rows is None else x[:, :rows]) + attended
        x = x + self.mlp(self.norm2(x))
        return x, probabilities


class VisionTransformer(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedding = PatchEmbedding(config)
        self.class_token = (
            nn.Parameter(torch.zeros(1, 1, config.dim)) if config.has_class_token else None
        )
        self.distillation_token = (
            nn.Parameter(torch.zeros(1, 1, config.dim)) if config.distillation_token else None
        )
        if config.position_embedding == "learned":
            self.position_embedding = nn.Parameter(torch.empty(1, config.num_tokens, config.dim))
        else:
            # Fixed, so not a parameter and not saved: it is rebuilt from the config.
            self.register_buffer(
                "position_embedding",
                sinusoidal_table(config.num_tokens, config.dim).unsqueeze(0),
                persistent=False,
            )
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        if config.representation_size is not None:
            self.pre_logits = nn.Sequential(
                nn.Linear(config.dim, config.representation_size), nn.Tanh()
            )
            head_in = config.representation_size
        else:
            self.pre_logits = nn.Identity()
            head_in = config.dim
        self.head = nn.Linear(head_in, config.num_classes)
        self.distillation_head = (
            nn.Linear(head_in, config.num_classes)
            if config.distillation_token and config.distillation_head
            else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's ViT init."""
        projection = self.patch_embedding.projection
        fan_in = projection.weight[0].numel()  # channels * patch * patch, conv or linear
        nn.init.trunc_normal_(projection.weight, std=math.sqrt(1.0 / fan_in))
        nn.init.zeros_(projection.bias)
        if isinstance(self.position_embedding, nn.Parameter):
            nn.init.normal_(self.position_embedding, std=0.02)
        for block in self.blocks:
            for linear in (block.attention.qkv, block.attention.projection):
                nn.init.xavier_uniform_(linear.weight)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            for linear in (block.mlp.fc1, block.mlp.fc2):
                nn.init.xavier_uniform_(linear.weight)
                nn.init.normal_(linear.bias, std=1e-6)
        if isinstance(self.pre_logits, nn.Sequential):
            linear = self.pre_logits[0]
            nn.init.trunc_normal_(linear.weight, std=math.sqrt(1.0 / linear.in_features))
            nn.init.zeros_(linear.bias)
        for head in (self.head, self.distillation_head):
            if head is not None:
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)

    def set_fused_attention(self, fused: bool) -> None:
        for block in self.blocks:
            block.attention.fused = fused and hasattr(F, "scaled_dot_product_attention")

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images)
        prefix = [t for t in (self.class_token, self.distillation_token) if t is not None]
        if prefix:
            x = torch.cat([*(t.expand(x.shape[0], -1, -1) for t in prefix), x], dim=1)
        return self.embedding_dropout(x + self.position_embedding)

    @property
    def read_rows(self) -> int | None:
        """How many leading tokens the heads read (the class token, and the distillation token
        when a head reads it), or None when they read every token (mean pooling)."""
        c = self.config
        if c.pooling != "token":
            return None
        return c.num_prefix_tokens if self.distillation_head is not None else 1

    def forward_features(
        self, images: torch.Tensor, return_attention: bool = False, rows: int | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every token's features, or with ``rows`` the first ``rows`` tokens': the last block
        then computes those only (its other tokens' outputs are read by no one), about 1/depth
        of the model's work for token pooling, the same numbers."""
        x = self.embed(images)
        maps = []
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            x, probabilities = block(x, return_attention, rows if last else None)
            if probabilities is not None:
                maps.append(probabilities)
        return (x if self.config.pooled_norm else self.norm(x)), maps

    def read(self, pooled: torch.Tensor) -> torch.Tensor:
        """What a head reads: the pooled features, normalised here with ``pooled_norm``."""
        return self.pre_logits(self.norm(pooled) if self.config.pooled_norm else pooled)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The class head's logits (or, with ``pre_logits``, what it reads)."""
        c = self.config
        if c.pooling == "token":
            pooled = features[:, 0]
        else:  # the patches' mean, without the class or distillation token
            patches = features[:, c.num_prefix_tokens :] if c.num_prefix_tokens else features
            pooled = patches.mean(dim=1)
        pooled = self.read(pooled)
        return pooled if pre_logits else self.head(pooled)

    def forward_heads(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(class head's logits, distillation head's logits or None): what training needs."""
        features, _ = self.forward_features(images, rows=self.read_rows)
        return self.forward_head(features), self.forward_distillation_head(features)

    def forward_distillation_head(self, features: torch.Tensor) -> torch.Tensor | None:
        if self.distillation_head is None:
            return None
        index = self.config.num_prefix_tokens - 1  # the distillation token is the last of them
        return self.distillation_head(self.read(features[:, index]))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The class head's logits, averaged with the distillation head's when there is one."""
        logits, distilled = self.forward_head(features), self.forward_distillation_head(features)
        return logits if distilled is None else (logits + distilled) / 2

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features, _ = self.forward_features(images, rows=self.read_rows)
        return self.logits(features)

    def forward_with_attention(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and attention probabilities, shape (batch, layers, heads, tokens, tokens), over
        the class token that token pooling reads (if any) and the patches: ``config.map_tokens``
        of them. The other prefix tokens' rows and columns (a distillation token, a class token
        beside mean pooling) are left out and each row renormalised to sum to 1: the attention
        among the tokens the service draws maps of (service/contract/attention_maps.py)."""
        features, maps = self.forward_features(images, return_attention=True)
        attention = torch.stack(maps, dim=1)
        if self.config.unmapped_tokens:
            attention = without_tokens(attention, self.config.unmapped_tokens)
        return self.logits(features), attention

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def without_tokens(attention: torch.Tensor, indices) -> torch.Tensor:
    """Attention probabilities (..., tokens, tokens) without the rows and columns of the tokens at
    ``indices``, each row renormalised to sum to 1 (a row whose kept tokens drew no attention at
    all, every probability underflowed to 0, stays 0 rather than 0 / 0)."""
    left_out = set(indices)
    kept = [i for i in range(attention.shape[-1]) if i not in left_out]
    attention = attention[..., kept, :][..., kept]
    total = attention.sum(dim=-1, keepdim=True)
    return attention / total.clamp_min(torch.finfo(attention.dtype).tiny)


class WithAttention(nn.Module):
    """Wraps a ViT so that ``forward`` returns (logits, attention): the graph exported for maps."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_with_attention(images)
