"""A model's logits as the probabilities every answer gives: one softmax, shared by the front ends'
answers and the engine's shadow comparison, so that both compare and report the same numbers."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float64 (a new array: ``logits`` is left as it is)."""
    probabilities = logits.astype(np.float64)  # a copy: the rest works in place
    probabilities -= probabilities.max(axis=-1, keepdims=True)
    np.exp(probabilities, out=probabilities)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    return probabilities
