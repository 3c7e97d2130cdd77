"""Triton's model configuration and statistics extensions over HTTP, read by ``tritonclient.http``'s
``get_model_config`` and ``get_inference_statistics``, and the health bodies KServe's clients expect.

The config is compared with the model's config.pbtxt parsed here with Triton's protobuf; the statistics
with what this module sent (every request through a model's pipeline counts: ``/predict``,
``/attention`` and ``/v2/.../infer``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.http as triton
from fastapi.testclient import TestClient
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from service.launcher.local_app import local_app
from tests.interop.eco_support import ECO, eco_server
from tests.support import MODEL_NAME, b64, encode, make_settings

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(model_repository: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("extensions-server") / "service.log"
    with eco_server(model_repository, log, max_queue_delay_ms=20) as (running, _):
        yield running


@pytest.fixture(scope="module")
def client(server) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.url.removeprefix("http://")) as http_client:
        yield http_client


def test_model_config_as_triton_answers_it(client, http, model_repository):
    on_disk = text_format.Parse(
        (model_repository / MODEL_NAME / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    expected = json_format.MessageToDict(on_disk, preserving_proto_field_name=True)
    config = client.get_model_config(MODEL_NAME)
    for key in ("name", "platform", "output", "version_policy"):
        assert config[key] == expected[key], key
    # the file's inputs only (the image files' input is served, not declared)
    assert config["input"] == expected["input"]
    assert config["input"][0]["dims"] == ["1", "28", "28"]  # protobuf's JSON: int64 as strings
    # The settings in force: the server runs max_batch_size 8 and a 20 ms delay (environment).
    assert expected["max_batch_size"] != 8 and config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "20000"
    assert client.get_model_config(MODEL_NAME, "1") == config
    with pytest.raises(InferenceServerException) as error:
        client.get_model_config("resnet50")
    assert error.value.status() == "404" and "unknown model 'resnet50'" in error.value.message()
    with pytest.raises(InferenceServerException) as error:
        client.get_model_config(MODEL_NAME, "3")
    assert error.value.status() == "404" and "unknown version '3'" in error.value.message()
    assert http.get(f"/v2/models/{MODEL_NAME}/versions/x/config").status_code == 404


def model_stats(client: triton.InferenceServerClient, *args: str) -> dict:
    (entry,) = client.get_inference_statistics(*args)["model_stats"]
    return entry


def stats_once_failed(client: triton.InferenceServerClient, failed: int, within_s: float = 10.0):
    """The model's statistics once they count more than ``failed`` failures (or at the limit)."""
    deadline = time.monotonic() + within_s
    while True:
        stats = model_stats(client, MODEL_NAME)
        if stats["inference_stats"]["fail"]["count"] > failed or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_statistics_count_every_route_exactly(client, http, fashion_images):
    everything = client.get_inference_statistics()  # GET /v2/models/stats, not a model 'stats'
    assert [e["name"] for e in everything["model_stats"]] == [MODEL_NAME]
    before = model_stats(client, MODEL_NAME)
    images = fashion_images[:6]
    predict = {"images": [{"pixels": image.tolist()} for image in images[:2]]}
    assert http.post("/predict", json=predict).status_code == 200
    tensor = {"name": "images", "shape": [3, 28, 28], "datatype": "UINT8"}
    infer = {"inputs": [{**tensor, "data": images[2:5].reshape(-1).tolist()}]}
    assert http.post(f"/v2/models/{MODEL_NAME}/infer", json=infer).status_code == 200
    attention = {"image": {"b64": b64(encode(images[5]))}, "format": "png"}
    assert http.post("/attention", json=attention).status_code == 200
    broken = {"images": [{"b64": b64(b"not an image at all")}]}
    assert http.post("/predict", json=broken).status_code in (400, 415, 422)
    # a request refused while decoding is counted by a one-way message from the front end that
    # refused it, which may be another than the one answering the statistics: wait for it
    after = stats_once_failed(client, before["inference_stats"]["fail"]["count"])
    assert model_stats(client, MODEL_NAME, "1") == after
    assert (after["name"], after["version"]) == (MODEL_NAME, "1")
    assert after["inference_count"] - before["inference_count"] == 6
    stats, earlier = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - earlier["success"]["count"] == 3
    assert stats["fail"]["count"] - earlier["fail"]["count"] == 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[stage]["count"] - earlier[stage]["count"] == 3, stage
        # an idle model runs a request at once: its time in the queue may be 0
        grew = int(stats[stage]["ns"]) - int(earlier[stage]["ns"])
        assert grew >= 0 if stage == "queue" else grew > 0, stage
    assert 3 <= after["execution_count"] - before["execution_count"] <= 4  # /predict may split
    assert (
        sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    )
    assert (
        sum(b["batch_size"] * b["compute_infer"]["count"] for b in after["batch_stats"])
        == after["inference_count"]
    )
    assert set(stats) >= {"cache_hit", "cache_miss"} and after["last_inference"] > 0
    with pytest.raises(InferenceServerException) as error:
        client.get_inference_statistics(MODEL_NAME, "2")
    assert error.value.status() == "404"


def test_health_bodies_for_kserve_and_status_codes_for_triton(client, http, model_repository):
    live, ready = http.get("/v2/health/live"), http.get("/v2/health/ready")
    assert (live.status_code, live.json()) == (200, {"live": True})
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    assert client.is_server_live() and client.is_server_ready()
    # An app whose lifespan has not run is not ready: 400, {"ready": false}.
    unstarted = TestClient(local_app(make_settings(model_repository, ECO)))
    not_ready = unstarted.get("/v2/health/ready")
    assert (not_ready.status_code, not_ready.json()) == (400, {"ready": False})
    assert unstarted.get("/v2/health/live").json() == {"live": True}


def test_the_extensions_are_announced(client):
    extensions = set(client.get_server_metadata()["extensions"])
    assert {"model_configuration", "statistics", "model_repository"} <= extensions
