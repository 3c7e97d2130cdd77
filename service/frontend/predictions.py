"""From logits to the API's predictions: softmax, best class, top-k.

``predictions`` works on a whole batch in one numpy pass and gives plain dicts in the response's JSON
shape (the ``Prediction`` schema), so that a 64-image answer costs little more than a one-image answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.contract.probabilities import softmax
from service.errors import InvalidInput
from service.frontend.schemas import Prediction


def check_top_k(top_k: int, labels: list[str], given: bool = True) -> int:
    """The top_k to answer: the default is capped at the model's classes; one asked for beyond
    them is a 422."""
    if not given:
        return min(top_k, len(labels))
    if top_k > len(labels):
        raise InvalidInput(
            f"top_k: {top_k} is more than the model's {len(labels)} classes; the limit is {len(labels)}",
            field="top_k",
        )
    return top_k


def predictions(logits: np.ndarray, labels: list[str], top_k: int) -> list[dict[str, Any]]:
    """Logits ``[n, classes]`` -> one prediction per row (ties go to the lower class index)."""
    probabilities = softmax(np.atleast_2d(logits))
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k].tolist()
    answers = []
    # the scores picked from Python lists: numpy's take_along_axis cost more than the rest together
    for row, indices in zip(probabilities.tolist(), order, strict=True):
        best = [{"label": labels[i], "index": i, "score": row[i]} for i in indices]
        answers.append({**best[0], "top_k": best})
    return answers


def prediction(logits: np.ndarray, labels: list[str], top_k: int) -> Prediction:
    """One image's logits -> its prediction, as the schema object."""
    return Prediction.model_validate(predictions(logits, labels, top_k)[0])
