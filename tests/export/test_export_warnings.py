"""``python -m export.onnx`` prints no warning: those torch raises from its own internals on our
export are filtered where we call it (export/onnx.py), so users see them neither in the export's
output nor in `make test`'s summary."""

from __future__ import annotations


def test_the_export_command_prints_no_warning(tiny_run, run_module, tmp_path):
    completed = run_module(
        "export.onnx",
        *(str(tiny_run), "--name", "quiet", "--version", "1", "--repo", str(tmp_path)),
        "--skip-accuracy",
    )
    assert completed.returncode == 0, completed.stderr
    assert "Warning" not in completed.stderr, completed.stderr
