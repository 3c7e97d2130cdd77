"""What the interoperability tests add to tests/support.py."""

from __future__ import annotations

import httpx
import numpy as np


def predict_probabilities(http: httpx.Client, images: np.ndarray) -> np.ndarray:
    """``/predict`` on uint8 [N, H, W] images (as pixels, never inverted): probabilities [N, classes].

    Sent 8 at a time, the servers' max_images_per_request."""
    rows = []
    for start in range(0, len(images), 8):
        body = {
            "images": [{"pixels": image.tolist()} for image in images[start : start + 8]],
            "top_k": 10,
            "invert": "never",
        }
        response = http.post("/predict", json=body)
        assert response.status_code == 200, response.text
        for prediction in response.json()["predictions"]:
            scores = {entry["index"]: entry["score"] for entry in prediction["top_k"]}
            rows.append([scores[i] for i in range(len(scores))])
    return np.asarray(rows)
