"""What the delivery tests share: the repository root, the tools `make test` installs, make's plan."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str) -> str | None:
    """A tool installed in this Python's environment (make test's .venv), else one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def require_tool(name: str, package: str) -> str:
    found = tool(name)
    if found is None:
        pytest.skip(f"{name} is not installed (make test installs {package})")
    return found


def make_dry_run(*args: str) -> str:
    """What ``make ARGS`` would run, without running it (and without installing anything)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        [make, "--no-print-directory", "-n", *args, "VENV=/nonexistent/venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout
