"""Model repository entries of ImageNet-sized ViTs with random weights, for measurements at the real size.

``python -m bench.heavy_models small --repo /tmp/heavy`` writes ``/tmp/heavy/vit-small/1/`` (both
graphs, labels, metadata, config.pbtxt) exactly as ``python -m export.onnx`` writes a trained run: the
same graphs (``export.onnx_graphs.build_graphs``), metadata document and repository writer. Sizes are the
ViT paper's (patch 16, 224 x 224 RGB, 1000 classes, token pooling); the weights are the model's own
initialisation, seeded, since nothing may be downloaded. ``--preprocessing resize-crop`` declares what
an imported Hugging Face or timm DeiT declares (shorter side 256, bicubic, centre 224 x 224, ImageNet
mean and std) instead of vitserve's own fit-pad. Nothing is verified against data: the graphs are
what the measurements load, not what they check.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from export.config import ViTConfig, get_preset
from export.data import get_dataset_spec
from export.model import VisionTransformer
from export.onnx_graphs import build_graphs, graph_document, with_metadata
from export.pixels import preprocessing_document
from export.repository import write_version

# (dim, depth, heads, mlp): ViT-Ti/16 is DeiT-tiny, ViT-S/16 DeiT-small, ViT-B/16 the paper's base
SIZES = {
    "tiny": (192, 12, 3, 768),
    "small": (384, 12, 6, 1536),
    "base": (768, 12, 12, 3072),
}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GEOMETRIES = ("fit-pad", "resize-crop")
SHORTER_SIDE = 256  # DeiT's: 224 / crop_pct 0.875


def config_for(size: str, image: int = 224) -> ViTConfig:
    """ViT-B/16's layout (``vit-b16``: patch 16, RGB, 1000 classes, token pooling) at ``size``'s
    widths and ``image`` pixels a side."""
    dim, depth, heads, mlp = SIZES[size]
    return get_preset("vit-b16").replace(
        image_height=image, image_width=image, dim=dim, depth=depth, heads=heads, mlp_dim=mlp
    )


def preprocessing_for(geometry: str, spec) -> dict:
    """The metadata's ``preprocessing`` for ``geometry``: vitserve's fit-pad from ``spec``, or a
    DeiT checkpoint's resize-crop (shorter side 256, bicubic, ImageNet mean and std)."""
    if geometry == "fit-pad":
        return preprocessing_document(spec)
    if geometry != "resize-crop":
        raise ValueError(f"geometry {geometry!r}: expected one of {', '.join(GEOMETRIES)}")
    return {
        "color": "rgb",
        "resize": "resize-crop",
        "shorter_side": SHORTER_SIDE,
        "resample": "bicubic",
        "polarity": "natural",
        "scale": 1.0 / 255.0,
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
    }


def write_heavy_model(
    size: str,
    repo: Path,
    name: str | None = None,
    seed: int = 0,
    geometry: str = "fit-pad",
    model: VisionTransformer | None = None,
) -> Path:
    """``<repo>/<name>/1/`` for a ViT of ``size`` with seeded random weights, preprocessed with
    ``geometry`` (one of :data:`GEOMETRIES`); returns its directory. ``model``: these weights
    instead (a model of ``size``'s config)."""
    config = config_for(size)
    if model is None:
        torch.manual_seed(seed)
        model = VisionTransformer(config).eval()
    elif model.config != config:
        raise ValueError(f"the model given is not a ViT of size {size!r}")
    spec = dataclasses.replace(
        get_dataset_spec("cifar10"),
        name="imagenet-like",
        labels=tuple(f"class-{i}" for i in range(config.num_classes)),
        height=config.image_height,
        width=config.image_width,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    )
    name = name or f"vit-{size}"
    graphs = build_graphs(model)
    labels = list(spec.labels)
    preprocessing = preprocessing_for(geometry, spec)
    for graph, proto in (("classifier", graphs.classifier), ("attention", graphs.attention)):
        document = graph_document(
            model, preprocessing, labels, name, 1, graph, "random", dataset=spec.name
        )
        with_metadata(proto, document)
    files = {"model.onnx": graphs.classifier, "attention.onnx": graphs.attention}
    return write_version(repo, name, 1, files, labels, config.image_shape, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.heavy_models", description=__doc__)
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("--repo", type=Path, required=True, help="model repository to write into")
    parser.add_argument("--name", default=None, help="model name (default vit-<size>)")
    parser.add_argument("--preprocessing", choices=GEOMETRIES, default="fit-pad")
    args = parser.parse_args(argv)
    print(write_heavy_model(args.size, args.repo, args.name, geometry=args.preprocessing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
