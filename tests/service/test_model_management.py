"""Model management: every model of the repository, live version swaps, Triton's repository extension.

The swaps run under load from several threads against the in-process app, which follows a copy of the
test repository (poll mode, a short poll interval); every wait is for an event (a state in the index, a
version in the answers), bounded generously, never a fixed sleep.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.contract.model_repository import ModelLoadError
from service.launcher.local_app import local_app
from tests.support import MODEL_NAME, assert_error, make_settings, wait_until

POLL_S = 0.1


@pytest.fixture
def repository(model_repository: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    return copy


def body(fashion_images) -> dict:
    return {"images": [{"pixels": fashion_images[0].tolist()}]}


def index(client: TestClient) -> dict[tuple[str, str], dict]:
    rows = client.post("/v2/repository/index").json()
    return {(row["name"], row["version"]): row for row in rows}


def stage_version(repository: Path, name: str, source: int, target: int) -> None:
    """What the export does: write the whole version beside the model, then rename it in."""
    staging = repository / name / f".staging-{target}"
    shutil.copytree(repository / name / str(source), staging)
    staging.rename(repository / name / str(target))


class Load:
    """Threads posting /predict in a loop, each recording (status, model version) of its answers
    in the order it got them. Order holds within a client only: a request admitted by version 1 just
    before a swap may finish after another client's first version 2 answer, so "never back to
    version 1" is checked per client, not across threads by completion time."""

    def __init__(self, client: TestClient, payload: dict, threads: int = 4) -> None:
        self.per_client: list[list[tuple[int, int | None]]] = [[] for _ in range(threads)]
        self._stop = threading.Event()

        def work(answers: list[tuple[int, int | None]]) -> None:
            while not self._stop.is_set():
                response = client.post("/predict", json=payload)
                version = (
                    response.json()["model"]["version"] if response.status_code == 200 else None
                )
                answers.append((response.status_code, version))  # one writer per list

        self._threads = [
            threading.Thread(target=work, args=(answers,)) for answers in self.per_client
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    @property
    def answers(self) -> list[tuple[int, int | None]]:
        return [answer for answers in self.per_client for answer in list(answers)]

    def statuses(self) -> set[int]:
        return {status for status, _ in self.answers}

    def latest_versions(self) -> set[int | None]:
        """The version of each client's latest answer."""
        return {answers[-1][1] for answers in self.per_client if answers}

    def client_versions(self) -> list[list[int | None]]:
        return [[version for _, version in list(answers)] for answers in self.per_client]


@pytest.fixture
def polling(repository: Path) -> Iterator[TestClient]:
    settings = make_settings(
        repository, model_control="poll", repository_poll_s=POLL_S, max_queue_delay_ms=5.0
    )
    with TestClient(local_app(settings)) as client:
        yield client


def test_a_new_version_takes_over_under_load_with_every_request_answered(
    polling, repository, fashion_images
):
    with Load(polling, body(fashion_images)) as load:
        wait_until(lambda: len(load.answers) > 20, "answers from version 1")
        stage_version(repository, MODEL_NAME, 1, 2)
        wait_until(lambda: load.latest_versions() == {2}, "every client answered by version 2")
        count = len(load.answers)
        wait_until(lambda: len(load.answers) > count + 20, "more answers after the swap")
    assert load.statuses() == {200}
    for versions in load.client_versions():  # each client: version 1, then version 2 for good
        first_two = versions.index(2)
        assert set(versions[:first_two]) <= {1} and set(versions[first_two:]) == {2}, versions
    # version 1 is released once its requests are answered (latest 1 is the policy)
    wait_until(lambda: ("tiny-vit", "1") not in index(polling), "version 1 released")
    assert index(polling)[(MODEL_NAME, "2")]["state"] == "READY"


def test_a_corrupt_version_is_refused_while_the_served_one_keeps_serving(
    polling, repository, fashion_images
):
    broken = repository / MODEL_NAME / ".staging-3"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"not an onnx graph")
    broken.rename(repository / MODEL_NAME / "3")
    wait_until(lambda: (MODEL_NAME, "3") in index(polling), "version 3 in the index")
    row = index(polling)[(MODEL_NAME, "3")]
    assert row["state"] == "UNAVAILABLE" and "onnxruntime cannot load" in row["reason"]
    response = polling.post("/predict", json=body(fashion_images))
    assert response.status_code == 200 and response.json()["model"]["version"] == 1
    assert index(polling)[(MODEL_NAME, "1")]["state"] == "READY"
    failures = polling.app.state.metrics.registry.get_sample_value(
        "vitserve_model_load_failures_total", {"model": MODEL_NAME}
    )
    assert failures >= 1
    assert_error(
        polling.post(f"/models/{MODEL_NAME}/versions/3/predict", json=body(fashion_images)),
        503,
        "not ready",
    )


def test_a_version_still_being_copied_is_never_served_half_written(polling, repository):
    """A plain copy (no staging) writes the graph in pieces, pausing longer than a scan: a piece may
    be tried and refused, never served; once the copy is whole the version is loaded."""
    source = (repository / MODEL_NAME / "1" / "model.onnx").read_bytes()
    target = repository / MODEL_NAME / "2"
    target.mkdir()
    pieces = [
        source[i : i + len(source) // 8 + 1] for i in range(0, len(source), len(source) // 8 + 1)
    ]
    with (target / "model.onnx").open("wb") as graph:
        for piece in pieces[:-1]:
            graph.write(piece)
            graph.flush()
            time.sleep(3 * POLL_S)  # several scans see it, changed and unchanged
            assert index(polling).get((MODEL_NAME, "2"), {}).get("state") != "READY"
        graph.write(pieces[-1])
    wait_until(
        lambda: index(polling).get((MODEL_NAME, "2"), {}).get("state") == "READY", "version 2"
    )


def test_rolling_back_by_removing_the_new_version(polling, repository, fashion_images):
    stage_version(repository, MODEL_NAME, 1, 2)
    wait_until(
        lambda: index(polling).get((MODEL_NAME, "2"), {}).get("state") == "READY", "version 2"
    )
    with Load(polling, body(fashion_images)) as load:
        wait_until(lambda: len(load.answers) > 10, "answers")
        shutil.rmtree(repository / MODEL_NAME / "2")
        wait_until(lambda: load.latest_versions() == {1}, "every client answered by version 1")
    assert load.statuses() == {200}


def test_explicit_load_and_unload(repository, fashion_images):
    settings = make_settings(repository, model_control="explicit", models=MODEL_NAME)
    with TestClient(local_app(settings)) as client:
        name = MODEL_NAME
        assert client.post(f"/v2/repository/models/{name}/unload").status_code == 200
        assert index(client)[(name, "")] == {
            "name": name,
            "version": "",
            "state": "UNAVAILABLE",
            "reason": "unloaded",
        }
        unloaded = client.post("/predict", json=body(fashion_images))
        assert_error(unloaded, 404, f"model '{name}' is not loaded", f"models/{name}/load")
        assert "retry-after" not in unloaded.headers  # it will not come back by itself
        assert client.get("/health/ready").status_code == 200  # Triton's: ready once up
        assert client.post(f"/v2/repository/models/{name}/load").status_code == 200
        assert index(client)[(name, "1")]["state"] == "READY"
        assert client.post("/predict", json=body(fashion_images)).status_code == 200
        missing = client.post("/v2/repository/models/nope/load")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
        (repository / name / "1" / "model.onnx").write_bytes(b"broken")
        failed = client.post(f"/v2/repository/models/{name}/load")
        assert failed.status_code == 400 and "onnxruntime cannot load" in failed.json()["error"]
        assert client.post("/predict", json=body(fashion_images)).status_code == 200  # kept


def test_explicit_mode_loads_only_the_models_named_at_start_up(repository, fashion_images):
    """Triton's --model-control-mode=explicit: no --load-model loads nothing; '*' loads all."""
    shutil.copytree(repository / MODEL_NAME, repository / "second")
    nothing = make_settings(repository, model_control="explicit", models=None, model_name=None)
    with TestClient(local_app(nothing)) as client:
        rows = index(client)
        assert {key: row["reason"] for key, row in rows.items()} == {
            (MODEL_NAME, ""): "unloaded",
            ("second", ""): "unloaded",
        }
        assert {row["state"] for row in rows.values()} == {"UNAVAILABLE"}
        assert client.get("/health/ready").status_code == 200
        assert client.get("/v2/health/ready").json() == {"ready": True}
        for path in ("/predict", "/models/second/predict"):
            answer = client.post(path, json=body(fashion_images))
            assert_error(answer, 404, "is not loaded")
        assert client.post("/v2/repository/models/second/load").status_code == 200
        assert client.post("/models/second/predict", json=body(fashion_images)).status_code == 200
        assert index(client)[(MODEL_NAME, "")]["reason"] == "unloaded"
    one = make_settings(repository, model_control="explicit", models="second", model_name=None)
    with TestClient(local_app(one)) as client:
        assert {row["state"] for row in index(client).values()} == {"READY", "UNAVAILABLE"}
        assert (
            client.post("/predict", json=body(fashion_images)).json()["model"]["name"] == "second"
        )
    every = make_settings(repository, model_control="explicit", models="*", model_name=None)
    with TestClient(local_app(every)) as client:
        assert {row["state"] for row in index(client).values()} == {"READY"}


def test_load_and_unload_need_explicit_mode(client):
    response = client.post(f"/v2/repository/models/{MODEL_NAME}/unload")
    assert response.status_code == 400 and "explicit" in response.json()["error"]


def test_two_models_each_with_its_own_batcher(repository, fashion_images):
    shutil.copytree(repository / MODEL_NAME, repository / "second")
    config = repository / "second" / "config.pbtxt"
    text = re.sub(r"max_batch_size: \d+", "max_batch_size: 3", config.read_text())
    config.write_text(text.replace(f'name: "{MODEL_NAME}"', 'name: "second"'))
    settings = make_settings(repository, max_batch_size=None)
    with TestClient(local_app(settings)) as client:
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert set(models) == {MODEL_NAME, "second"}
        assert models[MODEL_NAME]["default"] and not models["second"]["default"]
        assert models["second"]["batching"]["max_batch_size"] == 3
        for name in (MODEL_NAME, "second"):
            answer = client.post(f"/models/{name}/predict", json=body(fashion_images)).json()
            assert answer["model"] == {"name": name, "version": 1}
        registry = client.app.state.metrics.registry
        for name in (MODEL_NAME, "second"):
            runs = registry.get_sample_value(
                "vitserve_batch_size_count", {"model": name, "graph": "classifier"}
            )
            assert runs == 1
        v2 = client.post(
            "/v2/models/second/infer",
            json={
                "inputs": [
                    {"name": "images", "shape": [1, 28, 28], "datatype": "UINT8", "data": [0] * 784}
                ]
            },
        )
        assert v2.status_code == 200 and v2.json()["model_name"] == "second"


def test_models_named_in_the_setting_are_the_only_ones_served(repository):
    shutil.copytree(repository / MODEL_NAME, repository / "second")
    only_second = make_settings(repository, models="second", model_name=None)
    with TestClient(local_app(only_second)) as client:
        models = client.get("/models").json()["models"]
        assert [(m["name"], m["default"]) for m in models] == [("second", True)]
    absent = local_app(make_settings(repository, models="absent", model_name=None))
    with pytest.raises(ModelLoadError, match="VITSERVE_MODELS names 'absent'"), TestClient(absent):
        pass
    named_elsewhere = local_app(make_settings(repository, models="second"))
    with (
        pytest.raises(ModelLoadError, match=f"model '{MODEL_NAME}' not found"),
        TestClient(named_elsewhere),
    ):
        pass
