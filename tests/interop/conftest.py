"""Fixtures for the interoperability tests, over tests/conftest.py's shared ones: a real server on
this area's ports, and a module's own server with gRPC on (``served``) with clients of its gRPC port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc
from tritonclient.grpc import service_pb2_grpc

from tests.interop.eco_support import eco_server
from tests.support import INTEROP, Server, running_server


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
        model_repository, log, suite=INTEROP, max_queue_delay_ms=50, max_batch_size=8
    ) as running:
        yield running


@pytest.fixture(scope="module")
def eco_settings() -> dict[str, object]:
    """The settings of the module's ``served`` beyond the suite's; a module overrides this fixture
    to serve with others."""
    return {"max_queue_delay_ms": 5}


@pytest.fixture(scope="module")
def served(
    model_repository: Path, tmp_path_factory: pytest.TempPathFactory, eco_settings: dict
) -> Iterator[tuple[Server, int]]:
    """A real ``python -m service`` with gRPC on, for the module: (the server, its gRPC port)."""
    log = tmp_path_factory.mktemp("served") / "service.log"
    with eco_server(model_repository, log, **eco_settings) as running:
        yield running


@pytest.fixture(scope="module")
def grpc_client(served: tuple[Server, int]) -> Iterator[tritonclient.grpc.InferenceServerClient]:
    """Triton's own gRPC client on the gRPC port of the module's ``served``."""
    with tritonclient.grpc.InferenceServerClient(f"127.0.0.1:{served[1]}") as client:
        yield client


@pytest.fixture(scope="module")
def stub(served: tuple[Server, int]) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """A raw gRPC stub on the gRPC port of the module's ``served`` (its server and that port)."""
    with grpc.insecure_channel(f"127.0.0.1:{served[1]}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
