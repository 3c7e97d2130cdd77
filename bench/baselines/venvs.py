"""The anchors' own virtual environments: mosec and Triton run in venvs of their own, never in .venv
(requirements/serve.txt stays theirs-free; pytriton 0.7.0 needs numpy<2, the service numpy 2).

``ensure`` makes ``.venv-<name>`` with ``python -m venv`` and pip from the venv's pinned requirements
file (PyPI only) when it is missing or its requirements changed since (a stamp named after their hash,
as the Makefile's), and says so. The Triton venv's servers run with LD_LIBRARY_PATH holding the
interpreter's LIBDIR: tritonserver's Python backend stub links the system's libpython3.11 and, without
it, fails with "'_thread.RLock' object has no attribute '_recursion_count'".
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.server_process import REPO

STAMP_PREFIX = ".installed-"
PIP = ("-m", "pip", "install", "--disable-pip-version-check", "--quiet")


class VenvError(RuntimeError):
    """A venv could not be made; the message says how to make it by hand."""


def requirement_files(path: Path) -> list[Path]:
    """``path`` and every file it includes with ``-r``, in the order pip reads them."""
    found = [path]
    for line in path.read_text().splitlines():
        if line.strip().startswith(("-r ", "--requirement ")):
            found += requirement_files(path.parent / line.split(maxsplit=1)[1].strip())
    return found


@dataclass(frozen=True)
class Venv:
    name: str
    requirements: Path
    libpython: bool = False  # LD_LIBRARY_PATH gets the interpreter's LIBDIR

    @property
    def path(self) -> Path:
        return REPO / f".venv-{self.name}"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def stamp(self) -> Path:
        digest = hashlib.sha256()
        for file in requirement_files(self.requirements):
            digest.update(file.read_bytes())
        return self.path / f"{STAMP_PREFIX}{digest.hexdigest()[:16]}"

    def commands(self, base_python: str = sys.executable) -> list[list[str]]:
        """What makes the venv: ``python -m venv``, then pip from the requirements file."""
        return [
            [base_python, "-m", "venv", str(self.path)],
            [str(self.python), *PIP, "-r", str(self.requirements)],
        ]

    def pin(self, package: str) -> str:
        """The version ``package`` is pinned to (``==``) in this venv's requirements."""
        for file in requirement_files(self.requirements):
            for line in file.read_text().splitlines():
                name, sep, version = line.split("#")[0].strip().partition("==")
                if sep and name.strip().lower() == package:
                    return version.strip()
        raise KeyError(f"{package} is not pinned in {self.requirements}")

    def ready(self) -> bool:
        return self.stamp().is_file()

    def env(self, libdir: str | None = None) -> dict[str, str]:
        """What this venv's servers need on top of a clean environment."""
        if not self.libpython:
            return {}
        libdir = libdir or _libdir(self.python)
        rest = os.environ.get("LD_LIBRARY_PATH")
        return {"LD_LIBRARY_PATH": f"{libdir}:{rest}" if rest else libdir}


LIBDIR_CODE = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"


def _libdir(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", LIBDIR_CODE], capture_output=True, text=True, check=True
    ).stdout.strip()


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def ensure(venv: Venv, log: Path) -> Path:
    """The venv's python, made first when missing or stale (pip's output goes to ``log``)."""
    if venv.ready():
        return venv.python
    shown = _shown(venv.path)
    print(
        f"  making {shown} for the {venv.name} anchor from {_shown(venv.requirements)} "
        f"(PyPI; once, a minute or two); log: {log}",
        flush=True,
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as handle:
        for argv in venv.commands():
            done = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                by_hand = " && ".join(" ".join(a) for a in venv.commands())
                raise VenvError(
                    f"{shown}: `{' '.join(argv)}` exited {done.returncode} (log: {log}); "
                    f"make it by hand: {by_hand}"
                )
    for old in venv.path.glob(f"{STAMP_PREFIX}*"):
        old.unlink()
    venv.stamp().touch()
    return venv.python


REQUIREMENTS = REPO / "requirements"
MOSEC = Venv("mosec", REQUIREMENTS / "bench-mosec.txt")
TRITON = Venv("triton", REQUIREMENTS / "bench-triton.txt", libpython=True)
