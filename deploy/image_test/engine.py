"""The container engine the image test drives: Docker where its daemon answers, else podman.

Podman is driven through its Docker API (`podman system service` on a socket of this run's own),
so the same Compose CLI runs against either. Some sandboxes need settings of their own before
podman can build and start a container (ulimits that they allow, `runc` where crun refuses hybrid
cgroups, the host's CA bundle in build steps where egress re-signs TLS). Those are applied only to
this run's podman processes, and only where allowed: CI=true (a throwaway machine) or
VITSERVE_IMAGE_TEST_SANDBOX=1; never from the host's own configuration files, and never silently.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .steps import Failure, run, say, wait_for

SANDBOX_OPT_IN = "VITSERVE_IMAGE_TEST_SANDBOX"
# What a container inside the sandbox gets: the limits the sandbox lets a process keep.
NPROC = 32768


@dataclass
class Engine:
    """An engine's CLI, the environment that points it and Compose at the same daemon, and the
    extra options its builds take."""

    name: str
    env: dict[str, str]
    build_options: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout: float, check: bool = True):
        return run([self.name, *args], timeout=timeout, env=self.env, check=check)

    def image_exists(self, image: str) -> bool:
        return self("image", "inspect", image, timeout=60, check=False).returncode == 0

    def image_size(self, image: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", image, timeout=60).stdout)

    def build(self, *args: str, timeout: float) -> None:
        self("build", *self.build_options, *args, ".", timeout=timeout)

    def inspect(self, container: str, template: str) -> str:
        return self("inspect", "--format", template, container, timeout=60).stdout.strip()


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL
    )
    return probe.returncode == 0


def sandbox_allowed() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get(SANDBOX_OPT_IN) == "1"


def host_ca_bundle() -> Path | None:
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


def sandbox_settings(workdir: Path) -> tuple[dict[str, str], list[str]]:
    """The environment and build options of this run's podman processes inside a sandbox, each
    said aloud: a containers.conf of this run's own (CONTAINERS_CONF, read instead of the host's)
    with the ulimits the sandbox allows and runc, and the host's CA bundle mounted in builds."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if nofile == resource.RLIM_INFINITY:
        nofile = 1048576
    hard_nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = NPROC if hard_nproc == resource.RLIM_INFINITY else min(NPROC, hard_nproc)
    lines = [
        "[containers]",
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
    ]
    said = [f"ulimits nofile={nofile}, nproc={nproc} (the sandbox's own limits)"]
    if shutil.which("runc"):
        lines += ["[engine]", 'runtime = "runc"']
        said.append("the runc runtime (crun refuses hybrid cgroups)")
    conf = workdir / "containers.conf"
    conf.write_text("\n".join(lines) + "\n")
    options = []
    bundle = host_ca_bundle()
    if bundle is not None:
        options = ["--volume", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
        said.append(f"the host's CA bundle ({bundle}) in build steps (egress that re-signs TLS)")
    say("sandbox settings, for this run's podman only: " + "; ".join(said))
    return {"CONTAINERS_CONF": str(conf)}, options


def socket_answers(path: Path) -> bool:
    """Whether the Docker API on the unix socket ``path`` answers its ping."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        client.connect(str(path))
        client.sendall(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")
        status_line = client.recv(64).split(b"\r\n", 1)[0]
        return status_line.startswith(b"HTTP/1.") and b" 200 " in status_line + b" "


@contextmanager
def podman_service(workdir: Path, env: dict[str, str]) -> Iterator[str]:
    """`podman system service` on a socket in ``workdir`` for as long as the block runs; stopped
    (SIGTERM, then SIGKILL) on every way out. Yields the DOCKER_HOST that reaches it."""
    sock = workdir / "podman.sock"
    log = (workdir / "podman-service.log").open("w")
    process = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        say(f"podman's Docker API: unix://{sock} (process {process.pid})")

        def up() -> bool:
            if process.poll() is not None:
                text = (workdir / "podman-service.log").read_text()[-2000:]
                raise Failure(f"podman system service exited {process.returncode}:\n{text}")
            return sock.exists() and socket_answers(sock)

        wait_for("podman's API socket", up, timeout=60, interval=0.5)
        yield f"unix://{sock}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
        log.close()


@contextmanager
def engine(workdir: Path) -> Iterator[Engine]:
    """The engine this machine has, ready for the block: Docker, or podman behind its own API."""
    base_env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    if docker_answers():
        say("engine: Docker (its daemon answers)")
        yield Engine("docker", dict(os.environ))
        return
    if shutil.which("podman") is None:
        raise Failure(
            "no Docker daemon answers and podman is not installed "
            "(`make image-test` installs podman where apt-get can)"
        )
    version = run(["podman", "--version"], timeout=60).stdout.strip()
    say(f"engine: {version} (no Docker daemon answers), driven through its Docker API")
    extra_env: dict[str, str] = {}
    options: list[str] = []
    if sandbox_allowed():
        extra_env, options = sandbox_settings(workdir)
    else:
        say(f"no sandbox settings (allowed only with CI=true or {SANDBOX_OPT_IN}=1)")
    env = {**base_env, **extra_env}
    with podman_service(workdir, env) as docker_host:
        yield Engine("podman", {**env, "DOCKER_HOST": docker_host}, options)


def container_starts(engine: Engine, image: str) -> None:
    """Fail early, and say why, where this engine cannot start a container at all."""
    result = engine("run", "--rm", "--network", "none", image, "true", timeout=120, check=False)
    if result.returncode != 0:
        hint = (
            ""
            if sandbox_allowed() or engine.name != "podman"
            else f"; inside a sandbox that refuses podman's defaults (ulimits, crun), "
            f"{SANDBOX_OPT_IN}=1 lets this test set its own for this run only"
        )
        raise Failure(f"{engine.name} cannot start a container: {result.stdout.strip()}{hint}")
