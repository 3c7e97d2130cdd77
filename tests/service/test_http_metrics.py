"""vitserve_http_requests_total and vitserve_http_request_duration_seconds: every answer counted once,
under its own route template, method and status, and every request id answered back."""

from __future__ import annotations

import re

from tests.support import b64, encode, metric

COUNTER = "vitserve_http_requests_total"


def counts(client, **labels: str) -> float:
    return metric(client.get("/metrics").text, COUNTER, **labels)


def test_each_status_of_one_route_is_its_own_series(client, fashion_images):
    """A route answered 200, 422 and 200 again, and an unknown path: each answer lands in the series
    of its own status (the series are looked up once per route, method and status, and reused)."""
    route = {"route": "/predict", "method": "POST"}
    before = {status: counts(client, **route, status=status) for status in ("200", "422")}
    unmatched = counts(client, route="unmatched", status="404")
    good = {"images": [{"b64": b64(encode(fashion_images[0]))}]}
    assert client.post("/predict", json=good).status_code == 200
    assert client.post("/predict", json={"images": [], "top_k": 1}).status_code == 422
    assert client.post("/predict", json=good).status_code == 200
    assert client.get("/no/such/path").status_code == 404
    assert counts(client, **route, status="200") == before["200"] + 2
    assert counts(client, **route, status="422") == before["422"] + 1
    assert counts(client, route="unmatched", status="404") == unmatched + 1
    text = client.get("/metrics").text
    durations = metric(text, "vitserve_http_request_duration_seconds_count", **route)
    assert durations >= 3


def test_the_request_id_is_the_clients_or_a_new_random_one(client):
    mine = client.get("/health/live", headers={"X-Request-ID": "trace-42.a:b"})
    assert mine.headers["x-request-id"] == "trace-42.a:b"
    bad = client.get("/health/live", headers={"X-Request-ID": "not valid!"})
    made = {client.get("/health/live").headers["x-request-id"] for _ in range(3)}
    for request_id in (bad.headers["x-request-id"], *made):
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert len(made) == 3
    assert bad.headers["x-request-id"] not in made
