"""What the supervision tests (test_supervision.py, test_supervision_faults.py) kill: a real
``python -m service`` with two front ends, under the reliability suite's limits."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from tests.support import RELIABILITY, Server, running_server


def start(
    model_repository: Path, tmp_path: Path, log: str = "server.log"
) -> AbstractContextManager[Server]:
    """The service while the context lasts, its log in ``tmp_path / log``."""
    return running_server(model_repository, tmp_path / log, suite=RELIABILITY, workers=2)
