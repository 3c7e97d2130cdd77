"""``python -m bench``: its options and the document it writes around the sections."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from bench import run


def test_variant_option():
    assert run._variant("intra1:intra_op_threads=1") == ("intra1", {"intra_op_threads": "1"})
    assert run._variant("two:A=1, b=x") == ("two", {"a": "1", "b": "x"})
    for bad in ("intra1", "intra1:", ":a=1", "x:a"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME:setting=value"):
            run._variant(bad)


@dataclass
class Fine:
    value: int = 3

    def markdown(self) -> str:
        return "## Fine section"


def broken() -> Fine:
    raise RuntimeError("the server did not start")


def test_document_has_each_section_each_failure_and_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "steps", lambda args, out: {"model": Fine, "compare": broken})
    check = run.busy_check
    monkeypatch.setattr(run, "busy_check", lambda interval_s: check(interval_s=0.05))
    output = tmp_path / "B.md"
    argv = ["--quick", "--output", str(output), "--results-dir", str(tmp_path / "raw")]
    assert run.main(argv) == 1  # a step failed
    assert (tmp_path / "raw" / "model.json").read_text() == '{\n "value": 3\n}'
    text = output.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "SMOKE RUN" in text
    assert "**compare FAILED:** `RuntimeError: the server did not start`" in text
    assert "## Fine section" in text and "## Machine" in text and "| CPU |" in text
    assert "Written by `python -m bench --quick --output" in text


def test_only_a_whole_full_run_replaces_benchmarks_md(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "steps", lambda args, out: {"model": Fine})
    check = run.busy_check
    monkeypatch.setattr(run, "busy_check", lambda interval_s: check(interval_s=0.05))
    monkeypatch.setattr(run, "REPO", tmp_path / "repo")
    (tmp_path / "repo").mkdir()
    assert run.main(["--only", "model", "--results-dir", str(tmp_path / "raw")]) == 0
    assert not (tmp_path / "repo" / "BENCHMARKS.md").exists()
    assert "## Fine section" in (tmp_path / "raw" / "BENCHMARKS.md").read_text()
