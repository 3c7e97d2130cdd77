"""Checks on the service's container itself: what it runs as, its healthcheck, its stop, its logs."""

from __future__ import annotations

import json

from .engine import Engine
from .project import GPU_FILES, Project
from .steps import Failure, wait_for

# Run inside the container: who it runs as, with which capabilities, and whether the root is writable.
PROBE = """
import json, os
try:
    open("/app/written-by-the-image-test", "w")
    root = "writable"
except OSError as error:
    root = error.strerror
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"uid": os.getuid(), "root": root, "capabilities": int(status["CapEff"], 16)}))
"""
TELEMETRY_WARNING = "Failed to persist telemetry device ID"


def hardened(engine: Engine, container: str) -> str:
    result = engine("exec", container, "python", "-c", PROBE, timeout=60)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    if seen["uid"] in (0, None) or seen["root"] == "writable" or seen["capabilities"] != 0:
        raise Failure(f"expected a non-root user, a read-only root and no capabilities: {seen}")
    return f"uid {seen['uid']}, root: {seen['root']}, no capabilities"


def healthy(engine: Engine, container: str, timeout: float = 180) -> str:
    """Wait for the compose healthcheck to report healthy. Docker runs it on its own; podman runs
    it from systemd timers, which a machine without systemd lacks, so there the test asks podman
    to run the container's configured healthcheck, as the timer would."""

    def status() -> bool:
        if engine.name == "podman":
            engine("healthcheck", "run", container, timeout=60, check=False)
        return engine.inspect(container, "{{.State.Health.Status}}") == "healthy"

    wait_for("the healthcheck turning healthy", status, timeout=timeout, interval=2)
    return "healthy"


def no_telemetry_warning(project: Project) -> str:
    logs = project.logs(lines=400)
    if TELEMETRY_WARNING in logs:
        raise Failure(f"onnxruntime warned at start: {TELEMETRY_WARNING!r}")
    return "no onnxruntime warning in the start-up log"


def stops_on_sigterm(engine: Engine, project: Project, container: str) -> str:
    """`compose stop` sends SIGTERM and waits the stop grace period before SIGKILL: exit code 0
    means the service drained and exited on SIGTERM alone (SIGKILL would give 137)."""
    project.compose("stop", "vitserve", timeout=180)
    state = engine.inspect(container, "{{.State.Status}} {{.State.ExitCode}}")
    if state.split()[-1] != "0":
        raise Failure(f"after SIGTERM the container is {state!r}, not exited with 0")
    return f"exited 0 ({state})"


def leftovers(engine: Engine, project: Project) -> list[str]:
    label = f"label=com.docker.compose.project={project.name}"
    containers = engine("ps", "--all", "--filter", label, "--format", "{{.Names}}", timeout=60)
    networks = engine("network", "ls", "--filter", label, "--format", "{{.Name}}", timeout=60)
    return containers.stdout.split() + networks.stdout.split()


def down_leaves_nothing(engine: Engine, project: Project) -> str:
    """A plain `docker compose down` (docker-compose.yml alone, as a user types it)."""
    project.compose("down", files=GPU_FILES, timeout=240)
    left = leftovers(engine, project)
    if left:
        raise Failure(f"`docker compose down` left {left}")
    return "no container and no network left"


def sweep(engine: Engine, project: Project) -> None:
    """Remove whatever this run's project still has, however the run ended."""
    project.compose(
        "down", "--remove-orphans", "--timeout", "10", files=GPU_FILES, timeout=240, check=False
    )
    label = f"label=com.docker.compose.project={project.name}"
    containers = engine("ps", "--all", "--quiet", "--filter", label, timeout=60, check=False)
    for container in containers.stdout.split():
        engine("rm", "--force", container, timeout=120, check=False)
    for network in engine(
        "network", "ls", "--quiet", "--filter", label, timeout=60, check=False
    ).stdout.split():
        engine("network", "rm", network, timeout=60, check=False)
    for tag in ("cpu", "gpu", "export"):
        image = f"{project.images}:{tag}"
        if engine.image_exists(image):
            engine("rmi", image, timeout=120, check=False)
