"""Version strings of any length: more than 4,300 digits went past Python's int() digit
limit and answered 500 (gRPC INTERNAL) on infer, ready, metadata, config and stats. Every one is now
an unknown version: 404 (400 on /v2's ready, as for any version that is not ready), never a 5xx;
a 1 after 5000 zeros is version 1."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.launcher.local_app import local_app
from tests.support import MODEL_NAME, RELIABILITY, assert_error, free_port, make_settings

LONG = "9" * 5000
VERSIONS = [LONG, "1" + "0" * 4400, "0" * 5000 + "1", "99999999999999999999"]


@pytest.fixture(scope="module")
def served(model_repository) -> Iterator[tuple[TestClient, int]]:
    port = free_port(RELIABILITY.ports)
    settings = make_settings(model_repository, RELIABILITY, grpc_port=port)
    with TestClient(local_app(settings), raise_server_exceptions=False) as client:
        yield client, port


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{len(v)}-digits")
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/models/{name}/versions/{v}/infer"),
        ("GET", "/v2/models/{name}/versions/{v}/ready"),
        ("GET", "/v2/models/{name}/versions/{v}"),
        ("GET", "/v2/models/{name}/versions/{v}/config"),
        ("GET", "/v2/models/{name}/versions/{v}/stats"),
        ("POST", "/models/{name}/versions/{v}/predict"),
    ],
)
def test_a_long_version_is_an_unknown_version_over_http(served, method, path, version):
    client, _ = served
    url = path.format(name=MODEL_NAME, v=version)
    body = {"inputs": []} if "infer" in path else {"images": [{"pixels": [[0]]}]}
    response = client.request(method, url, json=body if method == "POST" else None)
    assert response.status_code < 500, (url[:80], response.status_code)
    assert response.status_code in (400, 404, 422) or version.lstrip("0") == "1"
    assert "Traceback" not in response.text


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{len(v)}-digits")
def test_a_long_version_is_an_unknown_version_over_grpc(served, version):
    _, port = served
    calls = [
        ("ModelReady", service_pb2.ModelReadyRequest(name=MODEL_NAME, version=version)),
        ("ModelMetadata", service_pb2.ModelMetadataRequest(name=MODEL_NAME, version=version)),
        ("ModelConfig", service_pb2.ModelConfigRequest(name=MODEL_NAME, version=version)),
        (
            "ModelStatistics",
            service_pb2.ModelStatisticsRequest(name=MODEL_NAME, version=version),
        ),
        ("ModelInfer", service_pb2.ModelInferRequest(model_name=MODEL_NAME, model_version=version)),
    ]
    codes = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, request in calls:
            try:
                getattr(stub, name)(request, timeout=30)
                codes.append((name, grpc.StatusCode.OK))
            except grpc.RpcError as error:
                codes.append((name, error.code()))
    fine = {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}
    assert all(code in fine for _, code in codes), codes


# issue "Reliability round five": a version beyond 64 bits passed the routes' ge=1 and broke the link
# (msgpack holds 64-bit integers): POST .../shadow/promote?version=<23 digits> hung for ever.
BEYOND = ["9223372036854775808", "99999999999999999999999"]  # 2**63, and the reported one


@pytest.mark.parametrize("version", BEYOND)
@pytest.mark.parametrize(
    "path",
    [
        "/models/{name}/shadow/promote?version={v}",
        "/models/{name}/versions/{v}/predict",
    ],
)
def test_a_version_beyond_the_largest_is_refused_422_naming_the_bound(served, path, version):
    client, _ = served
    body = {"images": [{"pixels": [[0]]}]}
    response = client.post(path.format(name=MODEL_NAME, v=version), json=body)
    error = assert_error(response, 422, "version", str(2**63 - 1))
    assert error["field"].endswith("version"), error


@pytest.mark.parametrize("version", BEYOND)
def test_a_protocol_version_beyond_the_largest_is_unknown_naming_the_bound(served, version):
    client, port = served
    for path in ("/v2/models/{name}/versions/{v}", "/v2/models/{name}/versions/{v}/config"):
        response = client.get(path.format(name=MODEL_NAME, v=version))
        assert response.status_code == 404, response.text
        assert f"from 1 to {2**63 - 1}" in response.json()["error"], response.text
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelConfigRequest(name=MODEL_NAME, version=version)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelConfig(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"from 1 to {2**63 - 1}" in refused.value.details()
