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
    """Both sides agree at every moment, and both count exactly the requests sent here (the app
    is shared with other tests: what they sent before is taken off)."""
    url = f"/v2/models/{MODEL_NAME}/versions/1/stats"
    before = client.get(url).json()["model_stats"][0]
    pixels = [{"pixels": image.tolist()} for image in fashion_images[:3]]
    assert client.post("/predict", json={"images": pixels[:1]}).status_code == 200
    assert client.post("/predict", json={"images": pixels[1:3]}).status_code == 200
    bad = client.post("/predict", json={"images": [{"pixels": [[300]]}]})
    assert bad.status_code == 422
    text = client.get("/metrics").text
    stats = client.get(url).json()["model_stats"][0]
    inference, earlier = stats["inference_stats"], before["inference_stats"]

    def grew(path: tuple[str, ...]) -> int:
        now, then = stats, before
        for key in path:
            now, then = now[key], then[key]
        return int(now) - int(then)

    assert sample(text, "nv_inference_request_success") == int(inference["success"]["count"])
    assert grew(("inference_stats", "success", "count")) == 2
    assert sample(text, "nv_inference_request_failure") == int(inference["fail"]["count"])
    assert grew(("inference_stats", "fail", "count")) == 1
    assert sample(text, "nv_inference_count") == int(stats["inference_count"])
    assert grew(("inference_count",)) == 3
    assert sample(text, "nv_inference_exec_count") == int(stats["execution_count"])
    assert grew(("execution_count",)) >= 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        ns = int(inference[stage]["ns"])
        assert ns > int(earlier[stage]["ns"]) or stage == "queue"
        assert abs(sample(text, f"nv_inference_{stage}_duration_us") - ns / 1000) < 1e-3
    every_ns = int(inference["success"]["ns"]) + int(inference["fail"]["ns"])
    assert abs(sample(text, "nv_inference_request_duration_us") - every_ns / 1000) < 1e-3
    assert "# TYPE nv_inference_count " in text and "nv_inference_count_total" not in text
