"""/metrics for the dashboards users already have: prometheus-client's process and platform metrics,
and Triton's ``nv_inference_*`` series under Triton's exact names and labels, agreeing with Triton's
statistics extension (``/v2/models/{name}/stats``) for the same requests."""

from __future__ import annotations

import re

from tests.support import MODEL_NAME


def sample(text: str, name: str) -> float:
    """The value of ``name{model=...,version="1"}`` written exactly as Triton writes it (no
    ``_total`` suffix, its two labels), as a dashboard's query would select it."""
    found = re.findall(rf'^{name}\{{model="{MODEL_NAME}",version="1"\}} (\S+)$', text, re.MULTILINE)
    assert len(found) == 1, f"no single {name} sample for {MODEL_NAME} version 1 in /metrics"
    return float(found[0])


def test_process_and_platform_metrics(client):
    text = client.get("/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert re.search(rf"^{name}(\{{.*\}})? \S+$", text, re.MULTILINE), f"no {name}"
    assert float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)[1]) > 1e6


def test_tritons_metrics_count_what_the_statistics_count(client, fashion_images):
    pixels = [{"pixels": image.tolist()} for image in fashion_images[:3]]
    assert client.post("/predict", json={"images": pixels[:1]}).status_code == 200
    assert client.post("/predict", json={"images": pixels[1:3]}).status_code == 200
    bad = client.post("/predict", json={"images": [{"pixels": [[300]]}]})
    assert bad.status_code == 422
    text = client.get("/metrics").text
    stats = client.get(f"/v2/models/{MODEL_NAME}/versions/1/stats").json()["model_stats"][0]
    inference = stats["inference_stats"]
    assert sample(text, "nv_inference_request_success") == inference["success"]["count"] == 2
    assert sample(text, "nv_inference_request_failure") == inference["fail"]["count"] == 1
    assert sample(text, "nv_inference_count") == stats["inference_count"] == 3
    assert sample(text, "nv_inference_exec_count") == stats["execution_count"] >= 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        ns = int(inference[stage]["ns"])
        assert ns > 0 or stage == "queue"
        assert abs(sample(text, f"nv_inference_{stage}_duration_us") - ns / 1000) < 1e-3
    every_ns = int(inference["success"]["ns"]) + int(inference["fail"]["ns"])
    assert abs(sample(text, "nv_inference_request_duration_us") - every_ns / 1000) < 1e-3
    assert "# TYPE nv_inference_count " in text and "nv_inference_count_total" not in text
