"""The hot routes (service/frontend/hot_routes.py) answer exactly as FastAPI's router does.

Two apps serve the same model. In one, the hot lane is on and learns each path from its first
request. In the other, the reference, the lane never learns a path, so every request goes through
FastAPI's routing, dependencies and exception middleware. Each case is sent to both, and the
answers must match: status, headers and body (the request id is sent, so it matches too). The HTTP
metrics must count a hot request under its route's template, as FastAPI's would be."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient
from starlette.responses import Response

from service.frontend.hot_routes import HotRoutes, check_hot_routes, hot
from service.frontend.serving import ServedVersion
from service.launcher.local_app import local_app
from tests.support import MAX_IMAGES, MODEL_NAME, b64, encode, make_settings, metric

KEY = "hot-key"
COMPARED_HEADERS = ("content-type", "content-length", "retry-after", "www-authenticate", "allow")
INFER = f"/v2/models/{MODEL_NAME}/infer"
CASES = (
    "predict",
    "predict multipart",
    "predict by name",
    "attention",
    "attention by name",
    "predict, broken JSON",
    "predict, too many images",
    "predict, top_k 0",
    "predict, not an image",
    "predict, unknown model",
    "predict, wrong method",
    "infer",
    "infer, one version",
    "infer, a BOOL tensor",
    "infer, version not a number",
    "infer, unknown model",
)


def lane(client: TestClient) -> HotRoutes:
    """The app's HotRoutes middleware (Starlette builds the stack at the first request)."""
    layer = client.app.middleware_stack
    while not isinstance(layer, HotRoutes):
        layer = layer.app
    return layer


def tensor_body(image: np.ndarray, datatype: str = "FP32") -> bytes:
    tensor = {"name": "images", "shape": [1, 1, 28, 28], "datatype": datatype}
    data = (image.astype(np.float32) / 255.0).ravel().tolist()
    return json.dumps({"inputs": [{**tensor, "data": data}]}).encode()


def request_of(case: str, fashion_images: np.ndarray) -> tuple[str, str, dict]:
    """(method, path, httpx arguments) of a case."""
    png = encode(fashion_images[3])
    one = {"images": [{"b64": b64(png)}], "top_k": 3}
    attend = {"image": {"b64": b64(png)}}
    as_json = {"content-type": "application/json"}
    oip = {"content": tensor_body(fashion_images[5]), "headers": as_json}
    return {
        "predict": ("POST", "/predict", {"json": one}),
        "predict multipart": (
            "POST",
            "/predict",
            {"files": [("files", ("a.png", png, "image/png"))], "data": {"top_k": "2"}},
        ),
        "predict by name": ("POST", f"/models/{MODEL_NAME}/predict", {"json": one}),
        "attention": ("POST", "/attention", {"json": attend}),
        "attention by name": ("POST", f"/models/{MODEL_NAME}/attention", {"json": attend}),
        "predict, broken JSON": (
            "POST",
            "/predict",
            {"content": b'{"images": [', "headers": as_json},
        ),
        "predict, too many images": (
            "POST",
            "/predict",
            {"json": {"images": one["images"] * (MAX_IMAGES + 1)}},
        ),
        "predict, top_k 0": ("POST", "/predict", {"json": {**one, "top_k": 0}}),
        "predict, not an image": ("POST", "/predict", {"json": {"images": [{"b64": "AAAA"}]}}),
        "predict, unknown model": ("POST", "/models/no-such-model/predict", {"json": one}),
        "predict, wrong method": ("GET", "/predict", {}),
        "infer": ("POST", INFER, oip),
        "infer, one version": ("POST", f"/v2/models/{MODEL_NAME}/versions/1/infer", oip),
        "infer, a BOOL tensor": (
            "POST",
            INFER,
            {"content": tensor_body(fashion_images[5], "BOOL"), "headers": as_json},
        ),
        "infer, version not a number": ("POST", f"/v2/models/{MODEL_NAME}/versions/x/infer", oip),
        "infer, unknown model": ("POST", "/v2/models/no-such-model/infer", oip),
    }[case]


def send(client: TestClient, method: str, path: str, arguments: dict, **headers: str):
    headers = {**arguments.get("headers", {}), "X-Request-ID": "same-id", **headers}
    return client.request(method, path, **{**arguments, "headers": headers})


def comparable(response) -> tuple:
    headers = {name: response.headers.get(name) for name in COMPARED_HEADERS}
    try:
        body = response.json()
    except ValueError:
        body = response.content
    return response.status_code, headers, body


@pytest.fixture(scope="module")
def apps(model_repository) -> Iterator[tuple[TestClient, TestClient]]:
    """(hot, reference): the same settings, the reference's lane never learning a path."""
    settings = make_settings(model_repository, api_key=KEY)
    with (
        TestClient(local_app(settings), raise_server_exceptions=False) as hot_client,
        TestClient(local_app(settings), raise_server_exceptions=False) as reference,
    ):
        reference.get("/v2/health/live")
        lane(reference).max_paths = 0
        yield hot_client, reference


AUTHORIZED = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("case", CASES)
def test_a_hot_route_answers_as_fastapi_does(apps, fashion_images, case):
    hot_client, reference = apps
    method, path, arguments = request_of(case, fashion_images)
    send(hot_client, method, path, arguments, **AUTHORIZED)  # FastAPI's; the lane learns the path
    hot_path = method == "POST" and "attention" not in path  # /attention returns a model, not hot
    assert ((method, "", path) in lane(hot_client).chosen) == hot_path
    answered = send(hot_client, method, path, arguments, **AUTHORIZED)
    expected = send(reference, method, path, arguments, **AUTHORIZED)
    assert comparable(answered) == comparable(expected)
    assert answered.headers["x-request-id"] == "same-id"
    assert not lane(reference).chosen


@pytest.mark.parametrize("case", ["predict", "predict by name", "infer", "infer, one version"])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong"], ids=["no key", "wrong key"])
def test_the_hot_lane_checks_the_api_key(apps, fashion_images, case, authorization):
    hot_client, reference = apps
    method, path, arguments = request_of(case, fashion_images)
    send(hot_client, method, path, arguments, **AUTHORIZED)
    assert (method, "", path) in lane(hot_client).chosen
    given = {} if authorization is None else {"Authorization": authorization}
    answered = send(hot_client, method, path, arguments, **given)
    assert answered.status_code == 401
    assert comparable(answered) == comparable(send(reference, method, path, arguments, **given))


def test_an_unexpected_error_is_the_same_500(apps, fashion_images, monkeypatch):
    hot_client, reference = apps
    method, path, arguments = request_of("predict", fashion_images)
    send(hot_client, method, path, arguments, **AUTHORIZED)

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug in the front end")

    monkeypatch.setattr(ServedVersion, "classify", broken)
    answered = send(hot_client, method, path, arguments, **AUTHORIZED)
    assert answered.status_code == 500
    assert comparable(answered) == comparable(
        send(reference, method, path, arguments, **AUTHORIZED)
    )
    # and, as behind FastAPI's router, the error reaches the server (Starlette's
    # ServerErrorMiddleware answers, then raises it again for the server to log)
    for client in (hot_client, reference):
        with pytest.raises(RuntimeError, match="a bug in the front end"):
            send(TestClient(client.app), method, path, arguments, **AUTHORIZED)


def test_hot_requests_are_counted_under_their_route(apps, fashion_images):
    hot_client, _ = apps
    method, path, arguments = request_of("predict, unknown model", fashion_images)
    template = "/models/{name}/predict"

    def count() -> float:
        text = hot_client.get("/metrics").text
        return metric(
            text, "vitserve_http_requests_total", route=template, method="POST", status="404"
        )

    send(hot_client, method, path, arguments, **AUTHORIZED)
    before = count()
    for _ in range(3):
        assert send(hot_client, method, path, arguments, **AUTHORIZED).status_code == 404
    assert count() == before + 3


def test_paths_are_learned_up_to_the_bound(apps, fashion_images):
    hot_client, _ = apps
    hot_lane = lane(hot_client)
    method, _, arguments = request_of("predict", fashion_images)
    hot_lane.max_paths = len(hot_lane.chosen) + 2
    try:
        for name in ("one", "two", "three"):
            send(hot_client, method, f"/models/{name}/predict", arguments, **AUTHORIZED)
        learned = {path for _, _, path in hot_lane.chosen}
        assert {"/models/one/predict", "/models/two/predict"} <= learned
        assert "/models/three/predict" not in learned
        answered = send(hot_client, method, "/models/three/predict", arguments, **AUTHORIZED)
        assert answered.status_code == 404  # through FastAPI, as before
    finally:
        hot_lane.max_paths = 1024


def test_an_endpoint_that_needs_fastapi_cannot_be_hot():
    async def returns_a_dict(request: Request) -> dict:
        return {}

    with pytest.raises(TypeError, match="a hot endpoint returns a Response"):
        hot(returns_a_dict)

    async def needed() -> str:
        return "x"

    @hot
    async def with_dependency(request: Request, value: str = Depends(needed)) -> Response:
        return Response()

    @hot
    async def with_int_path(request: Request, number: int) -> Response:
        return Response()

    @hot
    async def with_query(request: Request, name: str, limit: int = 3) -> Response:
        return Response()

    @hot
    async def plain(request: Request, name: str) -> Response:
        return Response()

    accepted = FastAPI()
    accepted.post("/plain/{name}")(plain)
    check_hot_routes(accepted.routes)
    for path, endpoint in (
        ("/dependency", with_dependency),
        ("/int/{number:int}", with_int_path),
        ("/query/{name}", with_query),
    ):
        app = FastAPI()
        app.post(path)(endpoint)
        with pytest.raises(TypeError, match="a hot endpoint takes only"):
            check_hot_routes(app.routes)
