"""From logits to the API's predictions: softmax, best class, top-k."""

from __future__ import annotations

import numpy as np

from service.errors import InvalidInput
from service.schemas import ClassScore, Prediction


def check_top_k(top_k: int, labels: list[str]) -> None:
    if top_k > len(labels):
        raise InvalidInput(
            f"top_k: {top_k} is more than the model's {len(labels)} classes; the limit is {len(labels)}",
            field="top_k",
        )


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    exponentials = np.exp(shifted)
    return exponentials / exponentials.sum(axis=-1, keepdims=True)


def prediction(logits: np.ndarray, labels: list[str], top_k: int) -> Prediction:
    """One image's logits -> its prediction (ties go to the lower class index)."""
    probabilities = softmax(logits)
    order = np.argsort(-probabilities, kind="stable")[:top_k]
    best = [ClassScore(label=labels[i], index=int(i), score=float(probabilities[i])) for i in order]
    return Prediction(label=best[0].label, index=best[0].index, score=best[0].score, top_k=best)
