"""Building the images: the CPU service image and the export image with torch for the CPU."""

from __future__ import annotations

import re
import sys

from .engine import Engine
from .project import Project
from .steps import ROOT, Failure, run, say

WHEELS = ROOT / "wheels"
BUILD_TIMEOUT = 900


def build_service(engine: Engine, project: Project) -> str:
    image = f"{project.images}:cpu"
    engine.build(
        "--target", "service", "--build-arg", "VARIANT=cpu",
        "--build-arg", f"PYTHON_IMAGE={project.python_image}", "--tag", image,
        timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    return image


def torch_pin() -> str:
    text = (ROOT / "requirements" / "export.txt").read_text()
    match = re.search(r"^torch==(\S+)$", text, re.MULTILINE)
    if match is None:
        raise Failure("requirements/export.txt pins no torch")
    return match.group(1)


def stage_cpu_torch(python_version: str) -> bool:
    """Put a CPU build of the pinned torch in wheels/ where this machine's pip can find one (its
    own wheel directories or indexes): the export build prefers it to any index. False where none
    is found; the build then asks the Dockerfile's TORCH_INDEX_URL."""
    wanted = f"{torch_pin()}+cpu"
    if any(WHEELS.glob(f"torch-{wanted}-*.whl")):
        say(f"torch {wanted}: the wheel already in wheels/")
        return True
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--dest", str(WHEELS), f"torch=={wanted}",
    ]  # fmt: skip
    result = run(command, timeout=900, check=False)
    if result.returncode == 0:
        say(f"torch {wanted}: found by this machine's pip, copied to wheels/")
        return True
    say(f"torch {wanted}: this machine's pip has none; the build asks TORCH_INDEX_URL")
    return False


def build_export(engine: Engine, project: Project) -> str:
    image = f"{project.images}:export"
    python_version = re.match(r"\d+\.\d+", project.python_image.rsplit(":", 1)[1])
    if python_version is None:
        raise Failure(f"no Python version in the base image's tag: {project.python_image}")
    index = ["--build-arg", "TORCH_INDEX_URL="] if stage_cpu_torch(python_version.group()) else []
    engine.build(
        "--target", "export", "--build-arg", f"PYTHON_IMAGE={project.python_image}", *index,
        "--tag", image, timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    return image


def size(engine: Engine, image: str) -> str:
    return f"{engine.image_size(image) / 1e6:.0f} MB"


def report_sizes(engine: Engine, project: Project, images: list[str]) -> list[str]:
    base = engine.image_size(project.python_image)
    lines = [f"base {project.python_image}: {base / 1e6:.0f} MB"]
    for image in images:
        total = engine.image_size(image)
        lines.append(f"{image}: {total / 1e6:.0f} MB ({(total - base) / 1e6:.0f} MB over the base)")
    for line in lines:
        say(f"size: {line}")
    return lines
