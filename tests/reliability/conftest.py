"""What the reliability tests do differently from tests/conftest.py's shared fixtures: their own
limits (tests/support.py's RELIABILITY), 16 images, and an app that answers a server error with a 500
instead of raising it into the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.launcher.local_app import local_app
from service.settings import Settings
from tests.support import RELIABILITY, encode, make_settings


@pytest.fixture(scope="session")
def fashion_images(fashion_images: np.ndarray) -> np.ndarray:
    """The first 16 of the shared Fashion-MNIST test images."""
    return fashion_images[:16].copy()


@pytest.fixture
def fashion_png(fashion_images: np.ndarray) -> bytes:
    """The first of them as a PNG file."""
    return encode(fashion_images[0])


@pytest.fixture(scope="session")
def settings(model_repository: Path) -> Settings:
    return make_settings(model_repository, RELIABILITY)


@pytest.fixture(scope="session")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(local_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each of test_schemathesis.py's operations gets its own node id.

    schemathesis names an operation's test ``test_...[POST /predict]``, but pytest 9.2 builds a
    node id from the test's original name and its parametrize call, which schemathesis does not
    use: all ~31 operations shared one id, and pytest-xdist's ``--dist loadfile``, which schedules
    by node id, silently ran one of them. The id is made from the name the item already has."""
    original = getattr(item, "originalname", None)
    operation = getattr(item, "operation_label", None)
    if operation is None or original is None or item.nodeid.endswith("]"):
        return
    item._id = item.parent.id.child(original).with_params(operation)  # type: ignore[union-attr]
