"""The one typed configuration of a Vision Transformer, and its named presets."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

Pooling = Literal["token", "mean"]
PositionEmbedding = Literal["learned", "sinusoidal"]
PatchEmbeddingKind = Literal["conv", "linear"]


@dataclass(frozen=True)
class ViTConfig:
    image_height: int = 28
    image_width: int = 28
    in_channels: int = 1
    patch_size: int = 4
    num_classes: int = 10
    dim: int = 64
    depth: int = 6
    heads: int = 4
    mlp_dim: int = 256
    pooling: Pooling = "mean"
    position_embedding: PositionEmbedding = "learned"
    # "conv": a Conv2d with kernel = stride = patch; "linear": reshape into patches, then a Linear
    # (seed 001's patchify). The same function of the same weights, laid out differently.
    patch_embedding: PatchEmbeddingKind = "conv"
    representation_size: int | None = None
    # DeiT's distillation token (Touvron et al., 2021): a second learned token beside the class token
    # (or the patches, with mean pooling), read by a head of its own that learns the teacher's
    # predictions. The logits are the mean of the two heads'.
    distillation_token: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    # A class token beside mean pooling (timm's ``global_pool='avg'`` with ``class_token=True``): it
    # takes part in attention but no head reads it. None: as the pooling has it (token pooling
    # reads one, mean pooling has none).
    class_token: bool | None = None
    # The final layer norm applied to what a head reads, after pooling, instead of to every token
    # (timm's ``fc_norm``, its default with ``global_pool='avg'``).
    pooled_norm: bool = False
    # Whether a distillation token has a head of its own (DeiT's model "with teacher"). Without one
    # the token only takes part in attention and the logits are the class head's (Hugging Face's
    # ``DeiTForImageClassification``).
    distillation_head: bool = True

    def __post_init__(self) -> None:
        for name in (
            "image_height",
            "image_width",
            "in_channels",
            "patch_size",
            "num_classes",
            "dim",
            "depth",
            "heads",
            "mlp_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.representation_size is not None and (
            not isinstance(self.representation_size, int) or self.representation_size < 1
        ):
            raise ValueError(
                f"representation_size must be at least 1 or None, got {self.representation_size}"
            )
        for side in ("image_height", "image_width"):
            if getattr(self, side) % self.patch_size:
                raise ValueError(
                    f"patch_size {self.patch_size} does not divide {side} {getattr(self, side)}: "
                    "choose a patch size that divides both image sides"
                )
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.position_embedding == "sinusoidal" and self.dim % 2:
            raise ValueError(f"sinusoidal position embedding needs an even dim, got {self.dim}")
        if not isinstance(self.distillation_token, bool):
            raise ValueError(
                f"distillation_token must be true or false, got {self.distillation_token!r}"
            )
        if self.pooling not in ("token", "mean"):
            raise ValueError(f"pooling must be 'token' or 'mean', got {self.pooling!r}")
        for name in ("qkv_bias", "pooled_norm", "distillation_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.class_token is not None and not isinstance(self.class_token, bool):
            raise ValueError(f"class_token must be true, false or null, got {self.class_token!r}")
        if self.pooling == "token" and self.class_token is False:
            raise ValueError("token pooling reads the class token: class_token cannot be false")
        if not self.distillation_head and not self.distillation_token:
            raise ValueError("distillation_head false needs a distillation token")
        eps = self.layer_norm_eps
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0.0 < eps < 1.0:
            raise ValueError(f"layer_norm_eps must be in (0, 1), got {eps!r}")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ValueError(
                f"position_embedding must be 'learned' or 'sinusoidal', got {self.position_embedding!r}"
            )
        if self.patch_embedding not in ("conv", "linear"):
            raise ValueError(
                f"patch_embedding must be 'conv' or 'linear', got {self.patch_embedding!r}"
            )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """One input image's (C, H, W)."""
        return self.in_channels, self.image_height, self.image_width

    @property
    def grid(self) -> tuple[int, int]:
        return self.image_height // self.patch_size, self.image_width // self.patch_size

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def has_class_token(self) -> bool:
        return self.pooling == "token" if self.class_token is None else self.class_token

    @property
    def num_prefix_tokens(self) -> int:
        """The learned tokens before the patches: [class token] [distillation token]."""
        return (1 if self.has_class_token else 0) + (1 if self.distillation_token else 0)

    @property
    def num_tokens(self) -> int:
        """The tokens the encoder runs on."""
        return self.num_prefix_tokens + self.num_patches

    @property
    def map_tokens(self) -> int:
        """The tokens of the attention maps the model reports (and exports): the class token that
        token pooling reads, if any, and the patches; a distillation token, and a class token that
        no head reads, are left out (``VisionTransformer.forward_with_attention``), so that the
        maps are the ones the service knows how to draw."""
        return self.num_patches + (1 if self.pooling == "token" else 0)

    @property
    def unmapped_tokens(self) -> range:
        """The indices of the prefix tokens the attention maps leave out (``map_tokens``)."""
        return range(1 if self.pooling == "token" else 0, self.num_prefix_tokens)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def description(self) -> dict:
        """``to_dict`` for a reader (the model card, the exported metadata): without
        ``distillation_head`` when there is no distillation token for it to be the head of (its
        default, true, would claim a head a plain ViT does not have)."""
        values = self.to_dict()
        if not self.distillation_token:
            del values["distillation_head"]
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> ViTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {', '.join(unknown)}")
        return cls(**values)

    def replace(self, **changes) -> ViTConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ViTConfig] = {
    # The seed's MNIST model (torchvision-style notebook): 28 px, patch 2, 2 layers, 2 heads.
    "mnist-tiny": ViTConfig(
        patch_size=2,
        dim=64,
        depth=2,
        heads=2,
        mlp_dim=256,
        pooling="token",
        representation_size=32,
    ),
    # The article's CIFAR-10 configuration (patch 4, hidden 48, 4 layers, 4 heads, mlp 192).
    "cifar10-small": ViTConfig(
        image_height=32,
        image_width=32,
        in_channels=3,
        patch_size=4,
        dim=48,
        depth=4,
        heads=4,
        mlp_dim=192,
        pooling="token",
    ),
    # ViT-Base/16 sizes (einops blog, torchvision vit_b_16).
    "vit-b16": ViTConfig(
        image_height=224,
        image_width=224,
        in_channels=3,
        patch_size=16,
        num_classes=1000,
        dim=768,
        depth=12,
        heads=12,
        mlp_dim=3072,
        pooling="token",
    ),
    # The model we ship: Fashion-MNIST, well under 1M parameters.
    "fashion-small": ViTConfig(
        patch_size=4,
        dim=96,
        depth=6,
        heads=4,
        mlp_dim=192,
        pooling="mean",
    ),
}


def get_preset(name: str) -> ViTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
