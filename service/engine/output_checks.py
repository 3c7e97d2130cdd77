"""Strict JSON out (issue 25): no answer carries NaN or Infinity.

A model whose outputs for an image hold a non-finite number answers that image's request 500 naming
the model (``non_finite_output``), counted in ``vitserve_non_finite_outputs_total``; the other
requests of the same batch are answered as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.errors import InferenceFailed
from service.observability.metrics import Metrics


def require_finite(
    outputs: Sequence[tuple[np.ndarray, ...]], model: str, graph: str, metrics: Metrics
) -> None:
    """Raise a 500 naming ``model`` when any image's outputs hold NaN or Infinity."""
    bad = sum(not all(np.isfinite(array).all() for array in image) for image in outputs)
    if bad:
        metrics.non_finite_outputs.labels(model, graph).inc(bad)
        raise InferenceFailed(
            f"model '{model}' ({graph} graph) produced NaN or Infinity for {bad} of "
            f"{len(outputs)} images; no answer is given for them",
            code="non_finite_output",
        )
