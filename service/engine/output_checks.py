"""Strict JSON out: no answer carries NaN or Infinity.

A model whose outputs for an image hold a non-finite number answers that image's request 500 naming
the model (``non_finite_output``), counted in ``vitserve_non_finite_outputs_total``; the other
requests of the same batch are answered as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.errors import InferenceFailed
from service.observability.metrics import Metrics


def finite_rows(outputs: Sequence[np.ndarray], count: int) -> np.ndarray | None:
    """Which of a batch's ``count`` rows hold only finite numbers in every output; None when all
    do (the usual case, checked with one pass over each output instead of one per row)."""
    if all(np.isfinite(output).all() for output in outputs):
        return None
    finite = np.ones(count, dtype=bool)
    for output in outputs:
        finite &= np.isfinite(output.reshape(count, -1)).all(axis=1)
    return finite


def require_finite(bad: int, count: int, model: str, graph: str, metrics: Metrics) -> None:
    """Raise a 500 naming ``model`` when ``bad`` of a request's ``count`` images held NaN or
    Infinity."""
    if bad:
        metrics.non_finite_outputs.labels(model, graph).inc(bad)
        raise InferenceFailed(
            f"model '{model}' ({graph} graph) produced NaN or Infinity for {bad} of "
            f"{count} images; no answer is given for them",
            code="non_finite_output",
        )
