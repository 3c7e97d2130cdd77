"""Fixtures for the interoperability tests: the service tests' fixtures, reused (interop_support.py
says how), plus a real server on this area's ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from interop_support import Server, running_server, service_fixtures

# The service tests' fixtures this directory uses (the tiny model is exported once per session).
_clean_environment = service_fixtures._clean_environment
model_repository = service_fixtures.model_repository
fashion_images = service_fixtures.fashion_images


@pytest.fixture(scope="session")
def fashion_test_set() -> tuple[np.ndarray, np.ndarray]:
    """The first 200 Fashion-MNIST test images (uint8 [N, 28, 28]) and their labels (int [N])."""
    from export.data import load_dataset

    _, test = load_dataset("fashion-mnist")
    return test.images[:200, 0].numpy().copy(), test.labels[:200].numpy().copy()


@pytest.fixture(scope="module")
def server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real ``python -m service`` process serving the tiny model, batching over 50 ms."""
    log = tmp_path_factory.mktemp("interop-server") / "service.log"
    with running_server(
        ["-m", "service"], model_repository, log, max_queue_delay_ms=50, max_batch_size=8
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
