"""Write a verified export into a model repository entry (Triton layout, docs/model-repository.md)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from export.model import VisionTransformer

if TYPE_CHECKING:
    from export.onnx import Graphs

TRITON_MAX_BATCH_SIZE = 64


def triton_config(name: str, model: VisionTransformer, max_queue_delay_us: int = 2000) -> str:
    c = model.config
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {TRITON_MAX_BATCH_SIZE}
input [
  {{
    name: "images"
    data_type: TYPE_FP32
    dims: [ {c.in_channels}, {c.image_height}, {c.image_width} ]
  }}
]
output [
  {{
    name: "logits"
    data_type: TYPE_FP32
    dims: [ {c.num_classes} ]
    label_filename: "labels.txt"
  }}
]
dynamic_batching {{
  max_queue_delay_microseconds: {max_queue_delay_us}
}}
version_policy: {{ latest: {{ num_versions: 1 }} }}
instance_group [ {{ kind: KIND_AUTO, count: 1 }} ]
"""


def write_entry(
    repo: Path,
    name: str,
    version: int,
    graphs: Graphs,
    model: VisionTransformer,
    labels: list[str],
    overwrite: bool,
) -> Path:
    """Write into a temporary directory first and move into place, so a failure leaves nothing."""
    entry = repo / name
    version_dir = entry / str(version)
    if version_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{version_dir} already exists; pass --overwrite to replace it or choose another --version"
        )
    entry.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=entry))
    try:
        onnx.save_model(graphs.classifier, staging / "model.onnx")
        onnx.save_model(graphs.attention, staging / "attention.onnx")
        (entry / "config.pbtxt").write_text(triton_config(name, model))
        (entry / "labels.txt").write_text("\n".join(labels) + "\n")
        if version_dir.exists():
            shutil.rmtree(version_dir)
        # mkdtemp makes the directory private; the service may run as another user.
        staging.chmod(0o755)
        staging.rename(version_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return version_dir
