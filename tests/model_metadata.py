"""A classifier's metadata document built for a test: the geometry and preprocessing it names, the
rest fixed (two labels, one layer, one head)."""

from __future__ import annotations

from typing import Any

from service.contract.model_repository import ModelMetadata


def classifier_metadata(
    *,
    name: str,
    channels: int,
    height: int,
    width: int,
    patch: int,
    preprocessing: dict[str, Any],
    pooling: str = "mean",
    class_token: bool = False,
) -> ModelMetadata:
    grid = [height // patch, width // patch]
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
