"""The anchors' venvs: what makes them, when they are made again, what their servers need, and their
pins. Nothing is installed here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench.baselines import venvs
from bench.baselines.venvs import MOSEC, TRITON, Venv, requirement_files

REQUIREMENTS = Path(venvs.REQUIREMENTS)
PIN = re.compile(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)")


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        if match := PIN.fullmatch(line.split("#")[0].strip()):
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(3)
    return found


def test_a_venv_is_made_with_venv_then_pip_from_its_requirements():
    venv = Venv("x", REQUIREMENTS / "bench-mosec.txt")
    make, install = venv.commands("/usr/bin/python3")
    assert make == ["/usr/bin/python3", "-m", "venv", str(venv.path)]
    assert venv.path.name == ".venv-x" and venv.path.parent == venvs.REPO
    assert install[:3] == [str(venv.path / "bin" / "python"), "-m", "pip"]
    assert install[-2:] == ["-r", str(REQUIREMENTS / "bench-mosec.txt")]
    assert venv.commands()[0][0] == sys.executable


def test_the_stamp_follows_every_included_requirements_file(tmp_path):
    (tmp_path / "base.txt").write_text("numpy==1\n")
    (tmp_path / "top.txt").write_text("# a comment\n-r base.txt\nmosec==0.9.8\n")
    assert requirement_files(tmp_path / "top.txt") == [tmp_path / "top.txt", tmp_path / "base.txt"]
    venv = Venv("x", tmp_path / "top.txt")
    first = venv.stamp()
    (tmp_path / "base.txt").write_text("numpy==2\n")  # an included file changed: made again
    assert venv.stamp() != first and venv.stamp().name.startswith(".installed-")
    assert not venv.ready()


def test_only_the_triton_servers_get_the_interpreters_libdir(monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert MOSEC.env() == {}
    assert TRITON.env("/opt/python/lib") == {"LD_LIBRARY_PATH": "/opt/python/lib"}
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/lib")
    assert TRITON.env("/opt/python/lib") == {"LD_LIBRARY_PATH": "/opt/python/lib:/usr/local/lib"}


def test_a_venv_that_cannot_be_made_says_how_to_make_it(tmp_path, monkeypatch):
    broken = Venv("never", tmp_path / "missing.txt")
    monkeypatch.setattr(Venv, "stamp", lambda self: tmp_path / "no-stamp")
    monkeypatch.setattr(Venv, "commands", lambda self: [[sys.executable, "-c", "exit(3)"]])
    with pytest.raises(venvs.VenvError, match=r"exited 3.*make it by hand"):
        venvs.ensure(broken, tmp_path / "venv.log")


def test_the_anchor_pins_agree_with_the_other_requirements_files():
    mosec = pins(REQUIREMENTS / "bench-mosec.txt")
    triton = pins(REQUIREMENTS / "bench-triton.txt")
    assert mosec["mosec"] == "0.9.8" and triton["nvidia-pytriton"] == "0.7.0"
    assert triton["numpy"].startswith("1.")  # pytriton 0.7.0 needs numpy<2
    assert "-r serve.txt" in (REQUIREMENTS / "bench-mosec.txt").read_text()
    others = {}
    for path in REQUIREMENTS.glob("*.txt"):
        if not path.name.startswith("bench-") and path.name != "serve-gpu.txt":
            others.update(pins(path))
    for name, version in (mosec | triton).items():
        if name != "numpy" and name in others:
            assert version == others[name], f"{name}: {version} here, {others[name]} elsewhere"
    serve = pins(REQUIREMENTS / "serve.txt")
    assert "mosec" not in serve and "nvidia-pytriton" not in serve


def test_a_pin_is_read_through_the_included_files():
    assert MOSEC.pin("mosec") == pins(REQUIREMENTS / "bench-mosec.txt")["mosec"]
    assert MOSEC.pin("numpy") == pins(REQUIREMENTS / "serve.txt")["numpy"]  # via -r serve.txt
    assert TRITON.pin("nvidia-pytriton") == "0.7.0"
    with pytest.raises(KeyError, match="torch"):
        TRITON.pin("torch")
