"""What the images must hold that test_delivery.py's file checks do not reach: no parser directive
that pulls a frontend, a home and a writable cache for the service's user, and the export image's
torch for the CPU (its pip options and its guard, run here as the build runs them).
`make image-test` builds and runs the images themselves."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.delivery.support import ROOT
from tests.delivery.test_compose import raw
from tests.delivery.test_delivery import dockerfile_stages, in_build_context

pytestmark = pytest.mark.delivery

DOCKERFILE = ROOT / "Dockerfile"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_no_parser_directive_makes_buildkit_pull_a_frontend():
    """`# syntax=docker/dockerfile:1` makes BuildKit pull that image from Docker Hub before the
    first step: a build behind a mirror or air-gapped fails there."""
    head = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    assert not [line for line in head if re.match(r"#\s*syntax\s*=", line, re.IGNORECASE)]


def test_the_service_user_has_a_home_and_a_cache_it_can_write():
    """onnxruntime persists its telemetry device ID under XDG_CACHE_HOME (else $HOME/.cache): that
    must lie under /tmp, the one place compose's read-only container can write."""
    stage = dockerfile_stages()["service"]
    run = " ".join(args for instruction, args in stage if instruction == "RUN")
    assert "useradd" in run and "--create-home" in run and "--no-create-home" not in run
    env = " ".join(args for instruction, args in stage if instruction == "ENV").split()
    (cache,) = [word.split("=", 1)[1] for word in env if word.startswith("XDG_CACHE_HOME=")]
    tmpfs = [mount.split(":")[0] for mount in raw()["x-service"]["tmpfs"]]
    assert any(cache == mount or cache.startswith(f"{mount}/") for mount in tmpfs), (cache, tmpfs)


def export_install() -> str:
    (install,) = [a for i, a in dockerfile_stages()["export"] if i == "RUN" and "pip install" in a]
    return install


def pip_options(environment: dict[str, str]) -> list[str]:
    """The options the export stage's RUN hands pip, run in sh as the build runs it."""
    install = export_install()
    assert install.startswith("--mount=type=bind,source=wheels,target=/tmp/wheels ")
    choose = install.removeprefix("--mount=type=bind,source=wheels,target=/tmp/wheels ")
    choose = choose.split("&& python3 -m venv")[0]
    result = subprocess.run(
        ["sh", "-c", f'{choose}; for word in "$@"; do echo "$word"; done'],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


@pytest.mark.parametrize(
    ("environment", "options"),
    [
        (
            {"TORCH": "cpu", "TORCH_INDEX_URL": CPU_INDEX},
            ["--find-links", "/tmp/wheels", "--extra-index-url", CPU_INDEX],
        ),
        ({"TORCH": "cpu", "TORCH_INDEX_URL": ""}, ["--find-links", "/tmp/wheels"]),
        ({"TORCH": "cuda", "TORCH_INDEX_URL": CPU_INDEX}, []),
    ],
    ids=["cpu", "cpu, wheels only", "cuda"],
)
def test_the_export_image_asks_pip_for_the_torch_it_wants(environment, options):
    assert pip_options(environment) == options


def test_the_export_image_defaults_to_the_cpu_torch_and_never_copies_the_wheels():
    stage = dockerfile_stages()["export"]
    args = dict(a.split("=", 1) for i, a in stage if i == "ARG")
    assert args == {"TORCH": "cpu", "TORCH_INDEX_URL": CPU_INDEX}
    assert in_build_context("wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    copies = [a for i, a in stage if i == "COPY"]
    assert not [a for a in copies if "wheels" in a], "wheels/ is mounted for pip, never copied"


@pytest.mark.parametrize(
    ("wanted", "cuda", "ok"),
    [("cpu", None, True), ("cpu", "13.0", False), ("cuda", "13.0", True), ("cuda", None, False)],
)
def test_the_export_build_stops_on_the_wrong_torch(tmp_path, wanted, cuda, ok):
    """The guard after pip, run against a stand-in torch module of either kind."""
    code = re.search(r'/opt/venv/bin/python -c "(.+)"$', export_install())
    assert code, export_install()
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        f"__version__ = '2.13.0'\nclass version:\n    cuda = {cuda!r}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)],
        env={"TORCH": wanted, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode == 0) == ok, result.stderr
    if not ok:
        assert f"TORCH={wanted}, but pip installed torch 2.13.0" in result.stderr
