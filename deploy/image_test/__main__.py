"""python -m deploy.image_test [--no-export]: build, run and check the images (see __init__)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from . import checks, container
from .base import base_image
from .engine import Engine, container_starts, engine
from .images import build_export, build_service, report_sizes
from .project import GPU_FILES, Project
from .steps import ROOT, Failure, fail_after, say, step

# Past this the run stops, cleans up and fails: far above the 10 minutes it takes from a clean
# clone, far below CI's limit.
TIME_LIMIT_S = 40 * 60
CHECKPOINT = ROOT / "checkpoints" / "fashion-small"
EXPORTED_VERSION = 2


def serve_and_check(engine: Engine, project: Project) -> str:
    """Start the CPU service as a user would (compose.cpu.yaml) and check it; its container id."""
    with step("compose up (docker-compose.yml + compose.cpu.yaml)"):
        project.compose("up", "--detach", "--no-build", timeout=300)
    ctr = project.container()
    base = project.url
    for name, check in (
        ("ready", lambda: checks.wait_ready(base) or f"{base}/health/ready"),
        ("/predict on Fashion-MNIST test images", lambda: checks.predict_right(base)),
        ("/attention as a PNG", lambda: checks.attention_png(base)),
        ("gRPC ready", lambda: checks.grpc_ready(project.grpc_port)),
        ("non-root, read-only root, no capabilities", lambda: container.hardened(engine, ctr)),
        ("the compose healthcheck", lambda: container.healthy(engine, ctr)),
        ("start-up log", lambda: container.no_telemetry_warning(project)),
    ):
        with step(name):
            say(f"  {check()}")
    return ctr


def export_and_serve(project: Project, exported: bool) -> None:
    """A new version in the mounted repository, picked up without a restart: exported inside the
    export image where it was built, else a copy of the shipped version."""
    with step(f"version {EXPORTED_VERSION} put into the mounted repository"):
        if exported:
            project.compose(
                "run", "--rm", "--no-deps",
                "--volume", f"{CHECKPOINT}:/app/checkpoint:ro",
                "export", "python", "-m", "export.onnx", "/app/checkpoint",
                "--name", checks.MODEL, "--version", str(EXPORTED_VERSION), "--repo", "models",
                "--skip-accuracy", timeout=900,
            )  # fmt: skip
            say(f"  export.onnx of {CHECKPOINT.relative_to(ROOT)} ran in the export image")
        else:
            model = project.directory / "models" / checks.MODEL
            shutil.copytree(model / "1", model / str(EXPORTED_VERSION))
            say("  a copy of version 1 (no export image in this run)")
    with step(f"version {EXPORTED_VERSION} served without a restart"):
        say(f"  {checks.serves_version(project.url, EXPORTED_VERSION)}")


def no_gpu_path(engine: Engine, project: Project) -> None:
    """A plain `docker compose up` on this host without a GPU: it must stop at once with the line
    that names the CPU command, and never start the service. The GPU image cannot be built here
    (no CUDA base image), so the CPU image stands in for it under the :gpu tag."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        say("this host has an NVIDIA GPU: the no-GPU path of `docker compose up` is not run here")
        return
    with step("plain `docker compose up` on a host without a GPU"):
        engine("tag", f"{project.images}:cpu", f"{project.images}:gpu", timeout=60)
        result = project.compose("up", "--no-build", files=GPU_FILES, timeout=300, check=False)
        line = "vitserve: no NVIDIA GPU on this host; serve on the CPU with:"
        if result.returncode == 0 or line not in result.stdout:
            raise Failure(
                f"expected exit non-zero with {line!r}; got {result.returncode}:\n{result.stdout[-2000:]}"
            )
        running = project.compose(
            "ps", "--quiet", "--status", "running", "vitserve", files=GPU_FILES, timeout=60
        )
        if running.stdout.strip():
            raise Failure("the GPU service started on a host without a GPU")
        say(
            f"  exit {result.returncode}: {next(x for x in result.stdout.splitlines() if line in x).strip()}"
        )
    with step("`docker compose down` after it"):
        say(f"  {container.down_leaves_nothing(engine, project)}")


def run_all(workdir: Path, with_export: bool) -> list[str]:
    with ExitStack() as stack:
        eng = stack.enter_context(engine(workdir))
        with step("the Python base image"):
            python_image = base_image(eng, workdir)
        with step("a container starts"):
            container_starts(eng, python_image)
        project = Project.create(workdir, eng.env, python_image)
        say(
            f"compose project {project.name}, ports {project.http_port} (HTTP), {project.grpc_port} (gRPC)"
        )
        stack.callback(container.sweep, eng, project)
        try:
            return check_images(eng, project, with_export)
        except Failure:
            say(f"the service's last log lines:\n{project.logs()}")
            raise


def check_images(eng: Engine, project: Project, with_export: bool) -> list[str]:
    """Build, size, run and check; the sizes measured."""
    builds = [build_service, build_export] if with_export else [build_service]
    what = "the CPU service image" + (" and the export image, side by side" if with_export else "")
    with step(f"build {what}"), ThreadPoolExecutor(len(builds)) as pool:
        images = [future.result() for future in [pool.submit(b, eng, project) for b in builds]]
    sizes = report_sizes(eng, project, images)
    ctr = serve_and_check(eng, project)
    export_and_serve(project, exported=with_export)
    with step("SIGTERM"):
        say(f"  {container.stops_on_sigterm(eng, project, ctr)}")
    with step("up again, then a plain `docker compose down`"):
        project.compose("up", "--detach", "--no-build", timeout=300)
        checks.wait_ready(project.url)
        say(f"  {container.down_leaves_nothing(eng, project)}")
    no_gpu_path(eng, project)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.image_test", description=__doc__)
    parser.add_argument("--no-export", action="store_true", help="skip the export image")
    args = parser.parse_args(argv)
    started = time.monotonic()
    fail_after(TIME_LIMIT_S)
    workdir = Path(tempfile.mkdtemp(prefix="vitserve-image-test-"))
    try:
        sizes = run_all(workdir, with_export=not args.no_export)
    except Failure as failure:
        say(f"FAILED after {time.monotonic() - started:.0f} s: {failure}")
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"passed in {time.monotonic() - started:.0f} s; " + "; ".join(sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
