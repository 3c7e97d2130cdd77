"""The Python base image the Dockerfile builds on: the official one, or a stand-in made here.

Where no image registry can be reached, the stand-in is bootstrapped with mmdebstrap from the
machine's own Debian sources: Debian's Python 3.11 (bookworm's), its venv module and the CA
certificates, under a name of its own (never the official one's), passed to the builds as
PYTHON_IMAGE, as a build behind a mirror or air-gapped would pass its own copy.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .steps import ROOT, Failure, run, say

STAND_IN_REPOSITORY = "localhost/vitserve-stand-in/python"
SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
# What the service and export builders use of the official image: python3 with venv and pip, and
# TLS roots for pip. Man pages, docs and locales are left out, as the slim image leaves them out.
PACKAGES = "python3,python3-venv,ca-certificates"
EXCLUDED = ("/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*")


def dockerfile_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    if match is None:
        raise Failure(f"the Dockerfile has no `ARG {name}=...`")
    return match.group(1)


def qualified(image: str) -> str:
    """``image`` with its registry and namespace spelled out, as Docker reads a short name
    (python:3.11 is docker.io/library/python:3.11): podman would match a short name against any
    local image of that last name, the stand-in's included."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." in first or ":" in first or first == "localhost":
        return image
    return f"docker.io/{image}"


def host_codename() -> str:
    text = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    match = re.search(r"^VERSION_CODENAME=(\S+)$", text, re.MULTILINE)
    return match.group(1) if match else "unknown"


def bootstrap(engine, workdir: Path, image: str, suite: str) -> None:
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        raise Failure("a stand-in base needs root and mmdebstrap (`make image-test` installs it)")
    if host_codename() != suite:
        raise Failure(
            f"a stand-in {suite} base needs a {suite} host's sources, not {host_codename()}"
        )
    sources = next((path for path in SOURCES if path.exists()), None)
    if sources is None:
        raise Failure(
            f"no Debian sources to bootstrap from (looked for {', '.join(map(str, SOURCES))})"
        )
    say(f"bootstrapping the stand-in {image} with mmdebstrap from {sources} ({suite}, {PACKAGES})")
    tarball = workdir / "base.tar"
    excludes = [f"--dpkgopt=path-exclude={pattern}" for pattern in EXCLUDED]
    command = ["mmdebstrap", "--variant=minbase", f"--include={PACKAGES}", *excludes]
    run([*command, suite, str(tarball), str(sources)], timeout=600)
    engine(
        "import", "--change", 'CMD ["python3"]', "--change", "ENV LANG=C.UTF-8",
        str(tarball), image, timeout=300,
    )  # fmt: skip
    tarball.unlink()


def base_image(engine, workdir: Path) -> str:
    """The image to pass as PYTHON_IMAGE: the official base where the engine has it or can pull
    it, else the stand-in (reused when an earlier run made it)."""
    official = qualified(dockerfile_default("PYTHON_IMAGE"))
    if engine.image_exists(official):
        say(f"base image: {official} (already here)")
        return official
    pulled = engine("pull", official, timeout=300, check=False)
    if pulled.returncode == 0:
        say(f"base image: {official} (pulled)")
        return official
    reason = (pulled.stdout.strip().splitlines() or ["no output"])[-1]
    say(f"base image: {official} could not be pulled ({reason[:200]})")
    tag = official.rsplit(":", 1)[1]
    stand_in = f"{STAND_IN_REPOSITORY}:{tag}"
    if engine.image_exists(stand_in):
        say(f"base image: the stand-in {stand_in}, bootstrapped by an earlier run")
        return stand_in
    bootstrap(engine, workdir, stand_in, suite=tag.rsplit("-", 1)[1])
    say(f"base image: the stand-in {stand_in}, bootstrapped from this machine's Debian sources")
    return stand_in
