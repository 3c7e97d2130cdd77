"""The Open Inference Protocol's JSON ``data``: numbers in any regular nesting are the tensor; anything
that only looks like a number (a boolean, a numeric string, null) is refused naming its element, also
where numpy would quietly convert it (the codec's one-call path must not take those)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import MODEL_NAME

URL = f"/v2/models/{MODEL_NAME}/infer"


def body(data: object) -> dict:
    return {
        "inputs": [{"name": "images", "shape": [1, 1, 28, 28], "datatype": "FP32", "data": data}]
    }


def test_nested_and_flat_data_give_the_same_answer(client, fashion_images):
    image = (fashion_images[0].astype(np.float64) / 255.0).round(6)
    flat = client.post(URL, json=body(image.reshape(-1).tolist()))
    nested = client.post(URL, json=body(image.reshape(1, 1, 28, 28).tolist()))
    assert flat.status_code == nested.status_code == 200, flat.text
    assert flat.json()["outputs"] == nested.json()["outputs"]


@pytest.mark.parametrize(
    ("element", "shown"), [(True, "true"), (False, "false"), ("0.5", '"0.5"'), (None, "null")]
)
def test_an_element_that_is_not_a_number_is_refused_by_its_position(client, element, shown):
    data = [0.25] * 784
    data[5] = element
    answer = client.post(URL, json=body(data))
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]
    assert "element 5" in message and shown in message and "not a number" in message


def test_ragged_data_is_refused(client):
    rows = [[0.5] * 28 for _ in range(28)]
    rows[3] = [0.5] * 27
    answer = client.post(URL, json=body([[rows]]))
    assert answer.status_code == 400, answer.text
    assert "784" in answer.json()["error"]
