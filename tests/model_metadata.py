"""A classifier's metadata document built for a test: the geometry and preprocessing it names, the
rest fixed (two labels, one layer, one head)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.contract.model_repository import ModelMetadata


def classifier_metadata(
    *,
    name: str,
    channels: int,
    height: int,
    width: int,
    patch: int,
    mean: Sequence[float],
    std: Sequence[float],
    pooling: str = "mean",
    class_token: bool = False,
    **preprocessing: Any,
) -> ModelMetadata:
    """Preprocessing: the colour ``channels`` implies, 8-bit pixels scaled to [0, 1], normalised with
    ``mean`` and ``std``, and the keys of ``preprocessing`` (resize, polarity, ...) added or put over
    those."""
    grid = [height // patch, width // patch]
    preprocessing = {
        "color": "grayscale" if channels == 1 else "rgb",
        "scale": 1 / 255,
        "mean": list(mean),
        "std": list(std),
        **preprocessing,
    }
    return ModelMetadata.model_validate(
        {
            "format": 1,
            "graph": "classifier",
            "name": name,
            "version": 1,
            "labels": ["a", "b"],
            "input": {
                "name": "images",
                "layout": "NCHW",
                "dtype": "float32",
                "channels": channels,
                "height": height,
                "width": width,
            },
            "preprocessing": preprocessing,
            "patch": {"size": patch, "grid": grid},
            "pooling": pooling,
            "class_token": class_token,
            "tokens": grid[0] * grid[1] + class_token,
            "depth": 1,
            "heads": 1,
        }
    )
