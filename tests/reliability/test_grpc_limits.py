"""gRPC bounds: metadata over ``max_header_bytes`` is refused before any handler runs,
and the listener keeps serving; the server advertises a bound on concurrent streams. (grpc's own
default bound, 8 KiB, let the 4000 bytes below through before the option was set.)"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.frontend.oip.grpc_limits import MAX_CONCURRENT_STREAMS, grpc_server_options
from service.launcher.local_app import local_app
from tests.support import RELIABILITY, free_port, make_settings


@pytest.fixture(scope="module")
def stub(model_repository) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    port = free_port(RELIABILITY.ports)
    settings = make_settings(model_repository, RELIABILITY, grpc_port=port, max_header_bytes=2048)
    with TestClient(local_app(settings)), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_metadata_over_the_header_limit_is_refused(stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.ServerLive(
            service_pb2.ServerLiveRequest(), metadata=[("x-big", "a" * 4000)], timeout=10
        )
    assert error.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
    answer = stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=[("x-small", "a" * 500)])
    assert answer.live


def test_the_options_bound_metadata_messages_and_streams(settings):
    options = dict(grpc_server_options(settings.server, settings.limits))
    assert options["grpc.max_metadata_size"] == settings.server.max_header_bytes
    assert options["grpc.max_receive_message_length"] == settings.limits.max_body_bytes
    assert options["grpc.max_concurrent_streams"] == MAX_CONCURRENT_STREAMS
