"""What the import tests share: randomising a source model, reading a written version back through
the service's contract, running its graphs, and the parity figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from service.contract.model_repository import ModelMetadata, parse_metadata, version_files

# ONNX against the source library's PyTorch: max abs difference over the logits' largest magnitude,
# and max abs difference of the attention probabilities.
LOGITS_PARITY = 1e-4
ATTENTION_PARITY = 1e-4


def random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A weight drawn afresh: layer norms around 1 and 0, matrices at the scale of their fan-in (so
    that attention does not saturate), tokens and position tables and biases at a fixed scale. A
    library's own init leaves norms at 1 and 0 and biases at 0, under which a swapped norm or a
    dropped bias would go unseen."""
    values = torch.randn(shape, generator=generator)
    if "norm" in name and name.endswith("weight"):
        return 1 + 0.3 * values
    if len(shape) >= 2 and not any(key in name for key in ("token", "position", "pos_embed")):
        return values * (shape[0] / values.numel()) ** 0.5
    return 0.5 * values


def randomise(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            parameter.copy_(random_weight(name, tuple(parameter.shape), generator))


def served(
    repo: Path, name: str
) -> tuple[ModelMetadata, ort.InferenceSession, ort.InferenceSession]:
    """The version's classifier metadata as the service reads it, and both graphs' sessions."""
    files = version_files(repo, name, 1)
    sessions = []
    for path, graph in ((files.classifier_path, "classifier"), (files.attention_path, "attention")):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        metadata = parse_metadata(session.get_modelmeta().custom_metadata_map, path, graph)
        sessions.append(session)
        if graph == "classifier":
            classifier_metadata = metadata
    return classifier_metadata, sessions[0], sessions[1]


def logits_error(ours: np.ndarray, reference: torch.Tensor) -> float:
    reference = reference.detach().numpy()
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def without_prefix(attention: torch.Tensor, left_out: list[int]) -> torch.Tensor:
    """The source's attention (batch, layers, heads, tokens, tokens) among the tokens the maps
    keep: the ``left_out`` rows and columns removed, each row renormalised."""
    kept = [i for i in range(attention.shape[-1]) if i not in left_out]
    attention = attention[..., kept, :][..., kept]
    return attention / attention.sum(-1, keepdim=True)
