"""``python -m service`` as a command line (service/launcher/cli.py): every setting a flag with Triton's
names where Triton has them, flags over the environment, one line per invalid value, and a gRPC port
that follows the HTTP port, so that two instances started with two ``PORT``s both come up."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib

import pytest

import service.__main__ as service_main
from bench import server_process
from service.launcher.cli import flag, parse_settings
from service.settings import Settings, setting_fields
from tests.support import REPO, server_env

# service tests' range (docs/ARCHITECTURE.md); each instance takes a port and the next one
SIDE_BY_SIDE_PORTS = range(18070, 18096)


def python_m_service(*argv: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python [python] -m service [argv]`` as a user runs it, with no VITSERVE_* of the caller's."""
    return subprocess.run(
        [sys.executable, *python, "-m", "service", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(REPO / "models", 18096),
    )


def test_help_lists_every_setting_with_its_default_and_variable_and_imports_nothing_heavy():
    result = python_m_service("--help", python=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps the help
    for name, field in setting_fields().items():
        assert flag(name) in text, f"--help lacks {flag(name)}"
        variable = "PORT" if name == "port" else f"VITSERVE_{name.upper()}"
        assert variable in text, f"--help does not name {variable}"
        default = {None: "unset", True: "true", False: "false", "": "empty"}.get(
            field.default, str(field.default)
        )
        assert f"[default: {default}; env: " in text, f"--help lacks the default of {name}"
    for triton in ("--model-repository", "--http-port", "--grpc-port", "--model-control-mode"):
        assert triton in text
    assert "--load-model" in text and "--log-verbose" in text and "--host" in text
    imported = set(re.findall(r"\|\s+([\w.]+)$", result.stderr, re.MULTILINE))
    heavy = {"onnxruntime", "fastapi", "numpy", "grpc", "torch"} & imported
    assert not heavy, f"--help imported {sorted(heavy)} before parsing"


def test_flags_win_over_the_environment_which_still_works(monkeypatch):
    monkeypatch.setenv("VITSERVE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("VITSERVE_MODEL_CONTROL", "poll")
    monkeypatch.setenv("PORT", "9100")
    env_settings = parse_settings([])
    assert (
        env_settings.batching.max_batch_size,
        env_settings.repository.model_control,
        env_settings.server.port,
    ) == (
        4,
        "poll",
        9100,
    )
    flag_settings = parse_settings(
        ["--max-batch-size", "16", "--model-control", "none", "--port", "9200", "--no-docs"]
    )
    assert (
        flag_settings.batching.max_batch_size,
        flag_settings.repository.model_control,
        flag_settings.server.port,
    ) == (
        16,
        "none",
        9200,
    )
    assert flag_settings.server.docs is False


def test_tritons_flag_names():
    settings = parse_settings(
        [
            "--model-repository",
            "/srv/models",
            "--http-port",
            "9300",
            "--grpc-port",
            "9400",
            "--model-control-mode",
            "explicit",
            "--load-model",
            "a",
            "--load-model",
            "b",
            "--repository-poll-secs",
            "2",
            "--exit-timeout-secs",
            "7",
            "--log-verbose",
            "1",
        ]
    )
    assert str(settings.repository.model_repository) == "/srv/models"
    assert (settings.server.port, settings.server.grpc_port) == (9300, 9400)
    assert settings.repository.model_control == "explicit" and settings.repository.model_list == [
        "a",
        "b",
    ]
    assert (settings.repository.repository_poll_s, settings.server.graceful_shutdown_s) == (
        2.0,
        7.0,
    )
    assert settings.server.log_level == "debug"
    every_settings = parse_settings(["--model-control-mode", "explicit", "--load-model", "*"])
    assert (
        every_settings.repository.loads_every_model and every_settings.repository.model_list == []
    )
    assert not parse_settings(["--model-control-mode", "explicit"]).repository.loads_every_model
    assert parse_settings(
        []
    ).repository.loads_every_model  # outside explicit mode, unset is every model


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--max-batch-size", "many"],
            "cannot start: setting --max-batch-size: Input should be a valid integer",
        ),
        (
            ["--load-model", "*", "--load-model", "a"],
            "cannot start: setting --models / --load-model: '*' (every model) cannot be combined",
        ),
        (
            ["--port", "65535"],
            "cannot start: settings: grpc_port is unset, so it would be port + 1",
        ),
        (
            ["--port", "9000", "--health-port", "9001"],
            "cannot start: settings: health_port (9001) must differ from port (9000) and "
            "grpc_port (9001)",
        ),
        (
            ["--port", "9000", "--health-port", "9000", "--grpc-port", "0"],
            "cannot start: settings: health_port (9000) must differ from port (9000)",
        ),
    ],
    ids=[
        "not a number",
        "star and a name",
        "no port after the last",
        "health on the gRPC port",
        "health on the HTTP port",
    ],
)
def test_an_invalid_flag_exits_2_with_one_line_naming_it(capsys, argv, line):
    with pytest.raises(SystemExit) as stopped:
        parse_settings(argv)
    assert stopped.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(line), errors


def test_an_invalid_flag_stops_the_process_before_anything_loads():
    result = python_m_service("--max-queue-delay-ms", "-1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith(
        "cannot start: setting --max-queue-delay-ms: Input should be greater than or equal to 0"
    )
    assert "Traceback" not in result.stderr


def test_the_grpc_port_follows_the_http_port():
    assert Settings().server.grpc_port == 8001  # Triton's pair
    assert Settings(port=9000).server.grpc_port == 9001
    assert Settings(port=9000, grpc_port=7000).server.grpc_port == 7000
    assert Settings(port=9000, grpc_port=0).server.grpc_port == 0  # off
    assert Settings().server.health_port == 0  # off unless asked: no third port to collide with


def _two_free_pairs() -> list[int]:
    """Two HTTP ports, each followed by a free port for its gRPC."""
    pairs = [
        port
        for port in SIDE_BY_SIDE_PORTS[::2]
        if server_process.port_is_free(port) and server_process.port_is_free(port + 1)
    ]
    assert len(pairs) >= 2, "no two free port pairs in the service tests' range"
    return pairs[:2]


@pytest.mark.slow
def test_two_instances_started_with_port_alone_both_become_ready(model_repository, tmp_path):
    """What `PORT=9000 make serve` beside a running `make serve` does: only the port differs,
    given as platforms give it (PORT) to one and as the Makefile does (VITSERVE_PORT) to the other."""
    import tritonclient.grpc as grpcclient

    processes = []
    try:
        for variable, port in zip(("PORT", "VITSERVE_PORT"), _two_free_pairs(), strict=True):
            env = server_env(model_repository, port)
            del env["VITSERVE_GRPC_PORT"]  # what a user sets: the port, and nothing else
            env[variable] = env.pop("PORT")
            log = tmp_path / f"server-{port}.log"
            process = server_process.spawn([sys.executable, "-m", "service"], env, log)
            processes.append((process, port, log))
        for process, port, log in processes:
            server_process.wait_ready(process, f"http://127.0.0.1:{port}", log, timeout_s=120)
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
            assert client.is_server_ready(), f"no gRPC on {port + 1}"
            client.close()
    finally:
        for process, _, _ in processes:
            server_process.stop_process(process)
    for process, port, log in processes:
        assert process.returncode == 0, f"instance on {port}:\n{server_process.log_tail(log)}"


def test_the_vitserve_script_runs_the_same_command_line():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["vitserve"].partition(":")
    assert getattr(importlib.import_module(module), function) is service_main.main
