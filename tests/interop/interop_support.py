"""What the interoperability tests share: the service tests' helpers, on this area's ports.

tests/service/conftest.py builds the tiny model with the export stage and runs real servers; it is
loaded here as a private module (its own name, so no other ``conftest`` is shadowed or shadows it) and
its port range set to this area's, 18300-18399 (docs/ARCHITECTURE.md), without touching the service
tests' own copy. Test modules import from here, never from ``conftest``: with several test directories
in one run, ``conftest`` may name another directory's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import numpy as np

_NAME = "_vitserve_service_fixtures"
if _NAME in sys.modules:
    service_fixtures = sys.modules[_NAME]
else:
    _path = Path(__file__).resolve().parents[1] / "service" / "conftest.py"
    _spec = importlib.util.spec_from_file_location(_NAME, _path)
    assert _spec is not None and _spec.loader is not None
    service_fixtures = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = service_fixtures  # dataclasses look their module up there
    _spec.loader.exec_module(service_fixtures)
    service_fixtures.PORTS = range(18300, 18400)  # the interoperability tests' loopback range

REPO: Path = service_fixtures.REPO
MODEL_NAME: str = service_fixtures.MODEL_NAME
Reference = service_fixtures.Reference
Server = service_fixtures.Server
encode = service_fixtures.encode
running_server = service_fixtures.running_server


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
