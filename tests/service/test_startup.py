"""Start-up and shutdown: a missing or corrupt model stops start-up with a clear message; readiness;
settings from the environment; the service never imports torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import onnx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from service.contract.model_repository import ModelLoadError
from service.launcher.http_server import _Server
from service.launcher.local_app import local_app
from service.settings import Settings, setting_fields
from tests.support import (
    MODEL_NAME,
    assert_error,
    make_settings,
    run_in_repo,
    run_python,
    server_env,
    start_process,
)


def copy_entry(repository: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "models"
    shutil.copytree(repository, copy)
    return copy


def start(settings: Settings) -> None:
    with TestClient(local_app(settings)):
        pass


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"model_name": "nope"},
            r"model 'nope' not found in .*; available: tiny-vit \(set VITSERVE_MODEL_NAME\)",
        ),
        ({"model_version": 7}, r"version 7 of model 'tiny-vit' not found .*; available: 1"),
    ],
)
def test_missing_model_stops_startup(model_repository, overrides, pattern):
    with pytest.raises(ModelLoadError, match=pattern):
        start(make_settings(model_repository, **overrides))


def test_missing_repository_stops_startup(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model repository .*absent is not a directory"):
        start(make_settings(tmp_path / "absent"))


def test_corrupt_or_incomplete_model_stops_startup(model_repository, tmp_path):
    repository = copy_entry(model_repository, tmp_path)
    version = repository / MODEL_NAME / "1"
    (version / "model.onnx").write_bytes(b"this is not an onnx file")
    with pytest.raises(ModelLoadError, match=r"model\.onnx: onnxruntime cannot load this model"):
        start(make_settings(repository))
    (version / "model.onnx").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.onnx is missing"):
        start(make_settings(repository))


def rewrite_metadata(path: Path, change) -> None:
    model = onnx.load(str(path))
    props = {p.key: p.value for p in model.metadata_props}
    del model.metadata_props[:]
    document = change(json.loads(props["vitserve"]))
    if document is not None:
        onnx.helper.set_model_props(model, {"vitserve": json.dumps(document)})
    onnx.save(model, str(path))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda d: None, r"has no 'vitserve' entry in its ONNX metadata_props"),
        (
            lambda d: {**d, "labels": d["labels"][:9]},
            r"logits have 10 classes but the metadata lists 9 labels",
        ),
        (lambda d: {**d, "tokens": 17}, r"invalid 'vitserve' metadata: .*tokens 17 should be 16"),
        (
            lambda d: {**d, "preprocessing": {**d["preprocessing"], "std": [0.0]}},
            r"std values must be positive",
        ),
        (lambda d: {**d, "format": 2}, r"format: Input should be 1"),
    ],
)
def test_bad_metadata_stops_startup(model_repository, tmp_path, change, pattern):
    repository = copy_entry(model_repository, tmp_path)
    rewrite_metadata(repository / MODEL_NAME / "1" / "model.onnx", change)
    with pytest.raises(ModelLoadError, match=pattern):
        start(make_settings(repository))


def test_labels_file_must_match_the_metadata(model_repository, tmp_path):
    """The version's labels.txt; a model-level one (the layout before labels moved into the
    version) only where the version has none."""
    repository = copy_entry(model_repository, tmp_path)
    (repository / MODEL_NAME / "1" / "labels.txt").write_text("a\nb\n")
    with pytest.raises(ModelLoadError, match=r"1/labels\.txt \(2 labels\) does not match"):
        start(make_settings(repository))
    (repository / MODEL_NAME / "1" / "labels.txt").unlink()
    (repository / MODEL_NAME / "labels.txt").write_text("a\nb\nc\n")
    with pytest.raises(ModelLoadError, match=r"tiny-vit/labels\.txt \(3 labels\) does not match"):
        start(make_settings(repository))


def test_missing_model_exits_the_process_with_the_message(model_repository, tmp_path):
    env = server_env(model_repository, 18099, model_name="nope")
    process = start_process(["-m", "service"], env, tmp_path / "fail.log")
    assert process.wait(timeout=60) == 3
    output = (tmp_path / "fail.log").read_text()
    assert "cannot start: model 'nope' not found" in output
    assert "available: tiny-vit" in output


def test_readiness_follows_the_lifecycle(model_repository, fashion_images):
    app = local_app(make_settings(model_repository))
    unstarted = TestClient(app)  # no lifespan: nothing loaded
    assert unstarted.get("/health/ready").status_code == 503
    assert unstarted.get("/health/ready").json() == {"status": "starting", "ready": False}
    assert unstarted.get("/health/live").status_code == 200
    error = assert_error(
        unstarted.post("/predict", json={"images": [{"pixels": [[0]]}]}), 503, "not loaded"
    )
    assert error["code"] == "not_ready"
    with TestClient(app) as client:
        assert client.get("/health/ready").status_code == 200
        app.state.frontend.begin_shutdown()  # what SIGTERM does first
        assert client.get("/health/ready").json() == {"status": "shutting_down", "ready": False}
        # requests already on their way are still served while draining
        assert (
            client.post(
                "/predict", json={"images": [{"pixels": fashion_images[0].tolist()}]}
            ).status_code
            == 200
        )
    assert app.state.frontend.phase == "stopped"


def test_a_model_still_loading_at_start_up_is_503_not_unknown(model_repository, monkeypatch):
    """The engine publishes its table while its first load runs (the front ends answer 503 meanwhile):
    a request for a repository model not reached yet must not hear that the model does not exist."""
    import asyncio

    from service.engine.core import Engine
    from service.engine.model_manager import ModelManager
    from service.errors import NotFound, ServiceUnavailable
    from service.observability.metrics import Metrics

    load = ModelManager._sync_model
    seen: dict[str, BaseException] = {}

    async def slow_load(manager, name, **kwargs):
        table = engine.table()  # what a front end holds during the load
        for asked in (None, MODEL_NAME, "no-such-model"):
            try:
                table.resolve(asked)
            except (NotFound, ServiceUnavailable) as error:
                seen[str(asked)] = error
        return await load(manager, name, **kwargs)

    monkeypatch.setattr(ModelManager, "_sync_model", slow_load)
    engine = Engine(make_settings(model_repository), Metrics())

    async def scenario():
        await engine.start()
        try:
            return engine.table().resolve(None).version
        finally:
            await engine.stop()

    assert asyncio.run(scenario()) >= 1
    for asked in ("None", MODEL_NAME):
        assert isinstance(seen[asked], ServiceUnavailable), seen[asked]
        assert seen[asked].code == "not_ready" and "retry" in str(seen[asked])
    assert isinstance(seen["no-such-model"], NotFound)  # not in the repository: unknown at once


def test_sigterm_turns_readiness_off_before_the_drain(model_repository):
    app = local_app(make_settings(model_repository))
    server = _Server(uvicorn.Config(app), app)
    app.state.frontend.phase = "ready"
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.frontend.phase == "shutting_down"
    assert server.should_exit


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("VITSERVE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("VITSERVE_API_KEY", "hunter2-secret")
    monkeypatch.setenv("PORT", "18123")
    settings = Settings()
    assert settings.batching.max_batch_size == 4 and settings.server.port == 18123
    assert (
        settings.server.api_key is not None
        and settings.server.api_key.get_secret_value() == "hunter2-secret"
    )
    assert "hunter2" not in repr(settings)
    monkeypatch.setenv("VITSERVE_PORT", "18124")
    assert Settings().server.port == 18124
    with pytest.raises(
        ValueError, match=r"max_queue_size \(4\) must be at least max_images_per_request \(8\)"
    ):
        Settings(max_queue_size=4, max_images_per_request=8)
    with pytest.raises(ValueError, match="provider"):
        Settings(provider="tpu")
    for name, field in setting_fields().items():
        assert field.description, (
            f"setting {name} has no description (the README table is built from them)"
        )


def test_the_service_never_imports_torch(model_repository):
    script = f"""
import sys
from fastapi.testclient import TestClient
import service.__main__
from service.launcher.local_app import local_app
from service.settings import Settings
app = local_app(Settings(model_repository={str(model_repository)!r}, model_name={MODEL_NAME!r},
                          max_batch_size=2, attention_max_batch_size=1))
with TestClient(app) as client:
    assert client.post("/predict", json={{"images": [{{"pixels": [[0] * 28] * 28}}]}}).status_code == 200
    assert client.post("/attention", json={{"image": {{"pixels": [[0] * 28] * 28}}, "format": "png"}}).status_code == 200
banned = sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "export", "matplotlib", "torchvision"}})
print("BANNED", banned)
"""
    result = run_python(script, server_env(model_repository, 18098))
    assert result.returncode == 0, result.stderr
    assert "BANNED []" in result.stdout


# what only the process that runs it needs: the web stack (front ends), the engine and onnxruntime
HEAVY = ("fastapi", "starlette", "uvicorn", "grpc", "onnxruntime", "service.engine.core",
         "service.frontend.app", "service.launcher.http_server")  # fmt: skip


def test_the_supervisor_and_the_entry_points_of_its_processes_import_nothing_heavy():
    """The supervisor imports only what it needs before it starts its processes, and each process
    imports the module of its entry point again (spawn) before doing its part: the web stack and the
    engine are imported by the processes that run them (each costs a second's CPU in every process
    that imports it at start-up: BENCHMARKS.md)."""
    script = f"""
import sys
import service.launcher.supervisor, service.launcher.processes
print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    result = run_python(script, {"PATH": os.environ.get("PATH", "")})
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


SECRET = "hunter2-secret"


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (
            {"api_key": SECRET, "max_queue_size": 1},
            "cannot start: settings: max_queue_size (1) must be at least max_images_per_request (8)",
        ),
        (
            {"api_key": SECRET, "max_batch_size": "many"},
            "cannot start: setting VITSERVE_MAX_BATCH_SIZE: Input should be a valid integer",
        ),
        ({"api_key": ""}, "cannot start: setting VITSERVE_API_KEY: api_key is set but empty"),
        (
            {"api_key": f"cl\u00e9-{SECRET}"},
            "cannot start: setting VITSERVE_API_KEY: api_key must be printable ASCII",
        ),
        (
            {"api_key": f"{SECRET} "},
            "cannot start: setting VITSERVE_API_KEY: api_key starts or ends with a space",
        ),
    ],
    ids=[
        "queue smaller than a request",
        "not a number",
        "empty key",
        "non-ASCII key",
        "spaced key",
    ],
)
def test_invalid_settings_exit_2_with_one_line_and_never_the_secret(
    model_repository, settings, line
):
    result = run_in_repo(["-m", "service"], server_env(model_repository, 18097, **settings))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.strip().splitlines() == [output.strip()], output  # one line
    assert output.startswith(line), output
    assert SECRET not in output and "Traceback" not in output


def test_an_api_key_that_no_header_can_carry_is_refused():
    for key in ("cl\u00e9", "tab\tkey", " lead", "trail ", "\u00a0", "\x00"):
        with pytest.raises(ValueError, match="api_key"):
            Settings(api_key=key)
    assert Settings(api_key="a key-with_printable.ASCII~").server.api_key is not None


def test_deadline_defaults_let_a_proxy_less_deployment_live():
    default_settings = Settings()
    # half-sent headers closed within 60 s
    assert default_settings.server.header_timeout_s <= 60
    assert default_settings.server.body_timeout_s <= 60
    # a 16 MiB body at the slowest rate that is never cut off takes under 20 minutes
    assert (
        default_settings.limits.max_body_bytes / default_settings.server.body_min_bytes_per_s
        < 20 * 60
    )


def test_the_engine_s_table_is_built_again_exactly_when_something_in_it_changed(model_repository):
    """Front ends are sent the table many times a second: the same table while nothing changed, a
    new one with a higher generation, telling the change, as soon as something has (a version's
    reason, the phase)."""
    import asyncio

    from service.engine.core import Engine
    from service.observability.metrics import Metrics

    engine = Engine(make_settings(model_repository), Metrics())

    async def scenario():
        await engine.start()
        try:
            first, again = engine.table(), engine.table()
            status = engine.manager.models[MODEL_NAME].versions[1]
            status.reason = "kept the loaded files; the new ones failed: a reason"
            reasoned = engine.table()
            engine.begin_shutdown()
            stopping = engine.table()
            return first, again, reasoned, stopping
        finally:
            await engine.stop()

    first, again, reasoned, stopping = asyncio.run(scenario())
    assert again is first
    assert reasoned.generation == first.generation + 1
    assert reasoned.models[MODEL_NAME].versions[1][1].startswith("kept the loaded files")
    assert stopping.generation == reasoned.generation + 1 and stopping.phase == "shutting_down"
