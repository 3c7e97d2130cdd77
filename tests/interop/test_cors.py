"""CORS with ``VITSERVE_CORS_ORIGINS``: off by default; when set, Starlette's middleware answers the
browser's preflight for the origins listed and refuses the others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.interop.eco_support import eco_app
from tests.support import BASE_SETTINGS, MODEL_NAME

ALLOWED = "https://app.example.com"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type, authorization",
}


@pytest.fixture(scope="module")
def cors_client(model_repository: Path) -> Iterator[TestClient]:
    with eco_app(
        model_repository, grpc=False, cors_origins=f" {ALLOWED} ,https://other.example.org"
    ) as client:
        yield client


def test_off_by_default_sends_no_cors_headers(model_repository):
    with eco_app(model_repository, grpc=False) as client:
        preflight = client.options("/predict", headers={"Origin": ALLOWED, **PREFLIGHT})
        assert "access-control-allow-origin" not in preflight.headers
        assert preflight.status_code == 405  # no route answers OPTIONS
        answer = client.get("/v2", headers={"Origin": ALLOWED})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize("path", ["/predict", f"/v2/models/{MODEL_NAME}/infer"])
def test_preflight_from_a_listed_origin_is_allowed(cors_client, path):
    response = cors_client.options(path, headers={"Origin": ALLOWED, **PREFLIGHT})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_preflight_from_another_origin_is_refused(cors_client):
    response = cors_client.options(
        "/predict", headers={"Origin": "https://evil.example.net", **PREFLIGHT}
    )
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers


def test_answers_to_a_listed_origin_expose_the_request_id(cors_client):
    body = {"images": [{"pixels": [[0] * 28] * 28}]}
    response = cors_client.post("/predict", json=body, headers={"Origin": ALLOWED})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()
    # an answer given before routing (the body limit) carries them too, so a page can read it
    too_large = cors_client.post(
        "/predict",
        content=b"0" * (int(BASE_SETTINGS["max_body_bytes"]) + 1),
        headers={"Origin": ALLOWED, "content-type": "application/json"},
    )
    assert too_large.status_code == 413
    assert too_large.headers["access-control-allow-origin"] == ALLOWED
    other = cors_client.get("/v2", headers={"Origin": "https://evil.example.net"})
    assert "access-control-allow-origin" not in other.headers


def test_any_origin(model_repository):
    with eco_app(model_repository, grpc=False, cors_origins="*") as client:
        response = client.options("/predict", headers={"Origin": "https://x.example", **PREFLIGHT})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"
