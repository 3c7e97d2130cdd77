"""An imported checkpoint with a large input, within every import bound: verified on as few images as
its size allows, or refused with the numbers when not even two fit, never an allocation the machine
cannot give.

Each export runs as ``python -m export.onnx`` with its private memory bounded (``RLIMIT_DATA``), so
an export that sized its probe images by the batch alone (64 images of 3 x 4,096 x 4,096 float32:
12.9 GB) fails there at once, and not on the machine.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from export.importers import load_imported
from export.onnx_graphs import VERIFY_MEMORY_BYTES, verification_bytes
from service.contract.model_repository import ModelMetadata, parse_metadata, version_files
from tests.export.conftest import REPO

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import onnx
    import transformers
    from transformers import ViTImageProcessorPil

transformers.logging.set_verbosity_error()

# The export's own bound, and what torch, onnxruntime and the weights take beside it.
MEMORY_LIMIT = VERIFY_MEMORY_BYTES + (3 << 30)


def checkpoint(directory: Path, image_size: int, patch_size: int) -> Path:
    """A Hugging Face ViT 8 wide, one layer deep, at ``image_size`` in patches of ``patch_size``."""
    config = transformers.ViTConfig(
        hidden_size=8,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=16,
        image_size=image_size,
        patch_size=patch_size,
        id2label={0: "small", 1: "large"},
    )
    transformers.ViTForImageClassification(config).save_pretrained(directory)
    ViTImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(
        directory
    )
    return directory


def bounded_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))


def export(directory: Path, repo: Path) -> subprocess.CompletedProcess[str]:
    argv = [str(directory), "--name", "large", "--version", "1", "--repo", str(repo)]
    return subprocess.run(
        [sys.executable, "-m", "export.onnx", *argv],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=220,
        preexec_fn=bounded_memory,
    )


@pytest.mark.timeout(240)  # two images of 4,096 x 4,096, and 100 MB of weights in each graph
def test_a_4096_pixel_input_is_verified_on_as_many_images_as_the_budget_holds(tmp_path):
    directory = checkpoint(tmp_path / "checkpoint", 4096, 1024)
    done = export(directory, tmp_path / "repo")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)["verification"]
    files = version_files(tmp_path / "repo", "large", 1)
    graph = onnx.load(str(files.classifier_path), load_external_data=False)
    metadata: ModelMetadata = parse_metadata(
        {p.key: p.value for p in graph.metadata_props}, files.classifier_path, "classifier"
    )
    assert (metadata.input.height, metadata.input.width) == (4096, 4096)
    # one image, then as many as the budget holds: more than one, fewer than 64
    sizes = [int(key.removeprefix("batch_")) for key in figures]
    assert sizes[0] == 1 and len(sizes) == 2 and 2 <= sizes[1] < 64
    per_image = verification_bytes(load_imported(directory).model.config)
    assert sizes[1] * per_image <= VERIFY_MEMORY_BYTES < (sizes[1] + 1) * per_image


def test_an_input_whose_attention_maps_no_budget_holds_is_refused_with_the_numbers(tmp_path):
    # 4,096 x 4,096 in patches of 16: 65,537 tokens, a 17 GB attention map an image
    directory = checkpoint(tmp_path / "checkpoint", 4096, 16)
    done = export(directory, tmp_path / "repo")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "export failed, nothing written: verifying the graphs against PyTorch" in done.stderr
    assert "3x4096x4096 pixels, 65,537 tokens, 1 layer(s) of 2 head(s)" in done.stderr
    assert not (tmp_path / "repo" / "large" / "1").exists()
