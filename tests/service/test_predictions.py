"""service/frontend/routers/predict.py's predictions: softmax, best class and top-k against values
worked out by hand.

Written against `make mutation`'s survivors: probabilities of logits chosen so that the answer is a
simple fraction, ties, top_k at and beyond the model's classes, and the JSON shape of each prediction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.contract.probabilities import softmax
from service.errors import InvalidInput
from service.frontend.routers.predict import check_top_k, prediction, predictions

LABELS = ["a", "b", "c", "d"]


def test_softmax_of_logs_is_the_normalised_numbers():
    # exp(log k) = k: the probabilities are 1/10, 2/10, 3/10, 4/10, whatever the shift
    logits = np.log(np.array([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])) + np.array(
        [[0.0], [500.0]]
    )
    np.testing.assert_allclose(
        softmax(logits), [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]], rtol=1e-12
    )


def test_softmax_is_stable_for_large_logits_and_computed_in_double_precision():
    logits = np.array([[1000.0, 1001.0]], np.float32)
    e = math.e
    np.testing.assert_allclose(softmax(logits), [[1 / (1 + e), e / (1 + e)]], rtol=1e-12)
    # float32 logits 1e-6 apart: their probabilities differ by about 5e-7, kept in float64
    close = softmax(np.array([[0.0, 1e-6]], np.float32))
    assert close.dtype == np.float64
    assert close[0, 1] - close[0, 0] == pytest.approx(5e-7, rel=1e-3)


def scored(label: str, index: int, score: float) -> dict:
    """One class of a prediction as the JSON carries it."""
    return {"label": label, "index": index, "score": pytest.approx(score)}


def test_predictions_list_the_top_k_in_order_with_labels_indices_and_scores():
    logits = np.log(np.array([[1.0, 4.0, 2.0, 3.0], [3.0, 1.0, 4.0, 2.0]]))
    answers = predictions(logits, LABELS, 3)
    top_ks = [
        [scored("b", 1, 0.4), scored("d", 3, 0.3), scored("c", 2, 0.2)],
        [scored("c", 2, 0.4), scored("a", 0, 0.3), scored("d", 3, 0.2)],
    ]
    # each answer is its best class, with the top k beside it
    assert answers == [{**top_k[0], "top_k": top_k} for top_k in top_ks]
    assert all(type(entry["score"]) is float for answer in answers for entry in answer["top_k"])


def test_ties_go_to_the_lower_class_index():
    logits = np.zeros((1, 40))
    logits[0, [7, 3, 30, 12]] = 1.0
    labels = [f"class {i}" for i in range(40)]
    (answer,) = predictions(logits, labels, 6)
    assert [entry["index"] for entry in answer["top_k"]] == [3, 7, 12, 30, 0, 1]
    assert answer["index"] == 3 and answer["label"] == "class 3"


def test_one_image_of_one_dimensional_logits_is_one_prediction():
    logits = np.log(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    (answer,) = predictions(logits, LABELS, 1)
    assert answer["label"] == "d" and answer["score"] == pytest.approx(0.4, rel=1e-6)
    schema = prediction(logits, LABELS, 2)
    assert (schema.label, schema.index, [entry.index for entry in schema.top_k]) == ("d", 3, [3, 2])
    assert schema.score == pytest.approx(0.4, rel=1e-6)


def test_top_k_by_default_is_capped_at_the_classes_and_asked_for_beyond_them_is_a_422():
    assert check_top_k(5, LABELS, given=False) == 4
    assert check_top_k(3, LABELS, given=False) == 3
    assert check_top_k(4, LABELS) == 4
    assert check_top_k(1, LABELS, given=True) == 1
    with pytest.raises(InvalidInput) as error:
        check_top_k(5, LABELS)
    assert error.value.field == "top_k"
    assert error.value.message == "top_k: 5 is more than the model's 4 classes; the limit is 4"


def test_softmax_shifts_each_row_by_its_own_maximum():
    """Rows 1000 apart: shifted by the batch's maximum, the first row's exponentials underflow to 0."""
    logits = np.array([[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]])
    np.testing.assert_allclose(softmax(logits), [[0.25, 0.75], [0.25, 0.75]], rtol=1e-12)


def test_softmax_is_over_the_last_axis_whatever_the_rank():
    row = np.log(np.array([1.0, 2.0, 5.0]))
    np.testing.assert_allclose(softmax(row), [0.125, 0.25, 0.625], rtol=1e-12)
    cube = np.stack([np.stack([row, row[::-1]])] * 2)  # [2, 2, 3]
    expected = np.array([[0.125, 0.25, 0.625], [0.625, 0.25, 0.125]])
    np.testing.assert_allclose(softmax(cube), np.stack([expected] * 2), rtol=1e-12)
