"""A model repository that changes under the service in hostile ways: a model folder
removed in poll mode is released and stops answering (it stayed READY, answering, before)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.contract.model_repository import ModelLoadError
from service.launcher.local_app import local_app
from tests.support import MODEL_NAME, RELIABILITY, free_port, make_settings


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
    return TestClient(local_app(settings), raise_server_exceptions=False)


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
        client.portal.call(client.app.state.frontend.engine.engine.manager.poll_once)
        assert client.post("/models/second/predict", json=pixels).status_code in (404, 503)
        assert client.get("/v2/models/second/ready").status_code != 200
        rows = index(client).get("second", [])
        assert all(row.get("state") != "READY" for row in rows), rows
        assert client.post(f"/models/{MODEL_NAME}/predict", json=pixels).status_code == 200


def explicit(repository: Path) -> TestClient:
    unset = dict.fromkeys(
        ("max_batch_size", "max_queue_delay_ms", "max_queue_size", "request_timeout_s")
    )
    settings = make_settings(repository, RELIABILITY, model_control="explicit", **unset)
    return TestClient(local_app(settings), raise_server_exceptions=False)


def set_config(repository: Path, text: str) -> None:
    (repository / "second" / "config.pbtxt").write_text(text)


def test_a_broken_config_is_named_once_and_everywhere(repository, service_log):
    with polled(repository) as client:
        manager = client.app.state.frontend.engine.engine.manager
        set_config(repository, "max_batch_size: [oops\n")
        for _ in range(3):
            client.portal.call(manager.poll_once)
        errors = [
            r for r in service_log.records if r.levelname == "ERROR" and "second" in r.getMessage()
        ]
        assert len(errors) == 1, [r.getMessage() for r in errors]  # not at every poll
        (row,) = index(client)["second"]
        assert row["state"] == "READY" and "second/config.pbtxt" in row["reason"], row
        assert str(repository) not in row["reason"]
        config = client.get("/v2/models/second/config")  # the config it is served with
        assert config.status_code == 200 and config.json()["max_batch_size"] > 0


def test_a_model_started_with_a_broken_config_says_why(repository):
    set_config(repository, "max_batch_size: [oops\n")
    with polled(repository) as client:
        response = client.get("/v2/models/second/config")
        assert response.status_code == 503, response.text
        assert "second/config.pbtxt" in response.text and str(repository) not in response.text
        (row,) = index(client)["second"]
        assert row["state"] == "UNAVAILABLE" and "line 1" in row["reason"], row


def test_config_files_are_parsed_off_the_event_loop(repository, monkeypatch):
    from service.engine import model_manager

    threads = []
    real = model_manager.model_config

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(model_manager, "model_config", spy)
    with polled(repository) as client:
        loop_thread = client.portal.call(threading.get_ident)
        set_config(repository, (repository / MODEL_NAME / "config.pbtxt").read_text() + "\n")
        client.portal.call(client.app.state.frontend.engine.engine.manager.poll_once)
    assert threads and loop_thread not in threads


@pytest.mark.parametrize(
    ("setting", "limit"),
    [
        ("max_batch_size: 1000000000", "max_batch_size must be at most 1024"),
        ("max_batch_size: 4096", "max_batch_size must be at most 1024"),
        (
            "instance_group { count: 50 }\ninstance_group { count: 50 }",
            "instance_count must be at most 64",
        ),
        (
            "dynamic_batching { max_queue_delay_microseconds: 100000000 }",
            "max_queue_delay_s must be at most 10",
        ),
        (
            "dynamic_batching { default_queue_policy { max_queue_size: 10000000 } }",
            "max_queue_size must be at most 65536",
        ),
        (
            "dynamic_batching { default_queue_policy { default_timeout_microseconds: 9000000000 } }",
            "request_timeout_s must be at most 3600",
        ),
    ],
)
def test_settings_beyond_their_maxima_are_refused_with_the_reason(repository, setting, limit):
    batch = "" if "max_batch_size" in setting else "max_batch_size: 8\n"
    set_config(repository, f'name: "second"\n{batch}{setting}\n')
    with explicit(repository) as client:
        response = client.post("/v2/repository/models/second/load")
        assert response.status_code == 400, response.text
        assert limit in response.text and str(repository) not in response.text
        rows = index(client)["second"]
        assert all(row["state"] != "LOADING" for row in rows), rows


def test_running_out_of_memory_while_loading_is_a_load_failure(repository, monkeypatch):
    from service.engine.runtime import Runtime

    with explicit(repository) as client:

        def no_memory(*args, **kwargs):
            raise MemoryError

        monkeypatch.setattr(Runtime, "load", no_memory)
        response = client.post("/v2/repository/models/second/load")
        assert response.status_code == 400 and "MemoryError" in response.text, response.text
        (row,) = index(client)["second"]
        assert row["state"] == "UNAVAILABLE" and "MemoryError" in row["reason"]


def test_load_errors_name_files_relative_to_the_repository(repository):
    (repository / "second" / "1" / "model.onnx").write_bytes(b"not onnx")
    with explicit(repository) as client:
        response = client.post("/v2/repository/models/second/load")
        assert response.status_code == 400 and "second/1/model.onnx" in response.text
        assert str(repository) not in response.text
        (row,) = index(client)["second"]
        assert str(repository) not in row["reason"] and "second/1/model.onnx" in row["reason"]


@pytest.mark.parametrize("dtype", ["STRING", "INT64", "FLOAT16", "BOOL"])
def test_a_model_whose_logits_are_not_float_is_unavailable(repository, dtype):
    import onnx

    path = repository / "second" / "1" / "model.onnx"
    graph = onnx.load(str(path))
    output = graph.graph.output[0]
    for node in graph.graph.node:
        node.output[:] = [f"{name}_float" if name == output.name else name for name in node.output]
    target = getattr(onnx.TensorProto, dtype)
    graph.graph.node.append(
        onnx.helper.make_node("Cast", [f"{output.name}_float"], [output.name], to=target)
    )
    output.type.tensor_type.elem_type = target
    onnx.save(graph, str(path))
    with explicit(repository) as client:
        response = client.post("/v2/repository/models/second/load")
        assert response.status_code == 400, response.text
        assert (
            "output 'logits' is tensor(" in response.text
            and "expected tensor(float)" in response.text
        )
        (row,) = index(client)["second"]
        assert row["state"] == "UNAVAILABLE" and "expected tensor(float)" in row["reason"]


def grpc_config(port: int, name: str) -> tuple[grpc.StatusCode, str]:
    """(code, details or the config's max_batch_size) of gRPC ModelConfig."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            answer = stub.ModelConfig(service_pb2.ModelConfigRequest(name=name), timeout=30)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, str(answer.config.max_batch_size)


def test_a_served_version_answers_the_config_it_was_loaded_with(repository, monkeypatch):
    """A new config.pbtxt that parses but fails to load (here: the load raises) leaves the version
    served with the old one: /config answers that one, and the index says the config is the cause
    (it answered the new file and said "kept the loaded files" before)."""
    from service.engine import model_manager

    real, broken = model_manager.Runtime.load, threading.Event()

    def load(*args):
        if broken.is_set():
            raise ModelLoadError("planted: no memory for the new batch size")
        return real(*args)

    monkeypatch.setattr(model_manager.Runtime, "load", load)
    with polled(repository) as client:
        served = client.get("/v2/models/second/config").json()
        assert "parameters" not in served
        text = (repository / "second" / "config.pbtxt").read_text()
        set_config(repository, text + 'parameters { key: "note" value { string_value: "new" } }\n')
        broken.set()
        client.portal.call(client.app.state.frontend.engine.engine.manager.poll_once)
        assert client.get("/v2/models/second/config").json() == served
        (row,) = index(client)["second"]
        assert row["state"] == "READY", row
        assert row["reason"].startswith("serving the previous config; the new one failed: "), row
        assert "planted" in row["reason"]


def test_a_refused_config_with_no_version_served_is_not_answered_as_served(repository):
    """Explicit mode: a model unloaded, its config.pbtxt broken, a load refused (400). Its config
    is not answered as if served (it was the stale file, 200, before), over HTTP and gRPC, and
    every answer about it names the file and the problem, as the index does."""
    port = free_port(RELIABILITY.ports)
    settings = make_settings(
        repository, RELIABILITY, model_control="explicit", models="second", grpc_port=port
    )
    with TestClient(local_app(settings), raise_server_exceptions=False) as client:
        assert client.get("/v2/models/second/config").status_code == 200
        assert client.post("/v2/repository/models/second/unload").status_code == 200
        set_config(repository, "max_batch_size: [oops\n")
        loaded = client.post("/v2/repository/models/second/load")
        assert loaded.status_code == 400 and "second/config.pbtxt" in loaded.text
        (row,) = index(client)["second"]
        assert row["state"] == "UNAVAILABLE" and "second/config.pbtxt" in row["reason"], row
        config = client.get("/v2/models/second/config")
        assert config.status_code == 503, config.text
        assert config.json()["error"].startswith("model 'second' has no valid config: ")
        assert row["reason"] in config.json()["error"]
        code, details = grpc_config(port, "second")
        assert code == grpc.StatusCode.UNAVAILABLE and row["reason"] in details, details
        metadata = client.get("/v2/models/second")
        assert metadata.status_code == 404 and row["reason"] in metadata.text, metadata.text
        assert client.get("/v2/models/second/ready").status_code == 400
        assert str(repository) not in config.text + details + metadata.text


def test_a_model_whose_config_is_refused_says_why_on_every_route(repository):
    """Poll mode, a model started with a broken config: metadata and inference answer 503 naming
    the problem ("not ready (unavailable); retry shortly" before, which no retry would change)."""
    set_config(repository, "max_batch_size: [oops\n")
    with polled(repository) as client:
        (row,) = index(client)["second"]
        pixels = {"images": [{"pixels": [[0] * 28] * 28}]}
        for answer in (
            client.get("/v2/models/second"),
            client.post("/models/second/predict", json=pixels),
        ):
            assert answer.status_code == 503, answer.text
            assert row["reason"] in answer.text and "retry shortly" not in answer.text


def test_a_version_directory_beyond_64_bits_is_ignored_and_the_table_still_travels(
    repository, service_log
):
    """A version directory named beyond 2**63 - 1 (the link's msgpack holds 64-bit integers) made
    every table update fail to encode in poll mode: the whole service answered 503. It is ignored,
    with one warning (not one per poll), and the table the engine sends still encodes."""
    from service.link import wire
    from service.link.protocol import TableUpdate

    pixels = {"images": [{"pixels": [[0] * 28] * 28}]}
    names = ["99999999999999999999999", "9223372036854775808", "0" * 30 + "9" * 200]
    with polled(repository) as client:
        engine = client.app.state.frontend.engine.engine
        for name in names:  # a real version's files: the latest-version policy would pick it
            shutil.copytree(repository / MODEL_NAME / "1", repository / MODEL_NAME / name)
        for _ in range(3):
            client.portal.call(engine.manager.poll_once)
        table = engine.table()
        message = wire.pack([(TableUpdate(1, 1, table), [])])  # what the engine would send
        (decoded,) = wire.unpack(memoryview(message), wire.to_front_end)
        assert decoded[0].table == table
        assert client.post(f"/models/{MODEL_NAME}/predict", json=pixels).status_code == 200
        versions = [row.get("version") for row in index(client)[MODEL_NAME]]
    assert versions == ["1"], versions
    warnings = [r.getMessage() for r in service_log.records if r.levelname == "WARNING"]
    for name in names:
        assert sum(name[:40] in w and "from 1 to" in w for w in warnings) == 1, warnings
