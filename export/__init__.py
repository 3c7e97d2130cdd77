"""Training and ONNX export (PyTorch). The service never imports this package."""

import importlib.util

if importlib.util.find_spec("torch") is None:  # `make serve` installs what serving needs, no torch
    raise SystemExit(
        "the export stage needs PyTorch and the export requirements, which `make serve` does not "
        "install: run `make export-env` (or `make test`), then `.venv/bin/python -m export...` "
        "again"
    )
