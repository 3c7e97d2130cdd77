"""A model repository that changes under the service in hostile ways (issue 25): a model folder
removed in poll mode is released and stops answering (it stayed READY, answering, before)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.frontend.app import create_app
from tests.support import MODEL_NAME, RELIABILITY, make_settings


@pytest.fixture
def repository(model_repository: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    shutil.copytree(copy / MODEL_NAME, copy / "second")
    config = copy / "second" / "config.pbtxt"
    config.write_text(config.read_text().replace(f'name: "{MODEL_NAME}"', 'name: "second"'))
    return copy


def polled(repository: Path) -> TestClient:
    settings = make_settings(
        repository, RELIABILITY, model_control="poll", repository_poll_s=3600.0
    )
    return TestClient(create_app(settings), raise_server_exceptions=False)


def index(client: TestClient) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in client.post("/v2/repository/index").json():
        rows.setdefault(row["name"], []).append(row)
    return rows


def test_a_removed_model_folder_is_released_in_poll_mode(repository):
    pixels = {"images": [{"pixels": [[0] * 28] * 28}]}
    with polled(repository) as client:
        assert client.post("/models/second/predict", json=pixels).status_code == 200
        shutil.rmtree(repository / "second")
        client.portal.call(client.app.state.service.manager.poll_once)
        assert client.post("/models/second/predict", json=pixels).status_code in (404, 503)
        assert client.get("/v2/models/second/ready").status_code != 200
        rows = index(client).get("second", [])
        assert all(row.get("state") != "READY" for row in rows), rows
        assert client.post(f"/models/{MODEL_NAME}/predict", json=pixels).status_code == 200
