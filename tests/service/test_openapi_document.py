"""The OpenAPI document reads well: stable operation ids (what generated clients name their methods),
the inference routes first in /docs and /redoc, and an example for every JSON request body."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.launcher.local_app import local_app
from service.settings import Settings


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    # creating the app loads nothing; /openapi.json needs no model
    return TestClient(local_app(Settings(grpc_port=0))).get("/openapi.json").json()


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]


def test_operation_ids_are_stable_names(document):
    ids = {f"{method} {path}": op["operationId"] for method, path, op in operations(document)}
    assert {key: ids[key] for key in ids if "predict" in key or "attention" in key} == {
        "POST /predict": "predict",
        "POST /models/{name}/predict": "predict_model",
        "POST /models/{name}/versions/{version}/predict": "predict_model_version",
        "POST /attention": "attention",
        "POST /models/{name}/attention": "attention_model",
        "POST /models/{name}/versions/{version}/attention": "attention_model_version",
    }
    assert ids["GET /health/ready"] == "ready"
    assert ids["POST /v2/models/{name}/infer"] == "v2_infer"
    assert ids["GET /v2/models/{name}/versions/{version}/ready"] == "v2_model_ready_version"
    assert len(set(ids.values())) == len(ids), "operation ids must be unique"
    generated = [i for i in ids.values() if i.endswith(("_get", "_post")) or "__" in i]
    assert not generated, f"FastAPI's generated ids: {generated}"


def test_inference_comes_first_in_the_docs(document):
    tags = [tag["name"] for tag in document["tags"]]
    assert tags[0] == "inference", tags
    assert all(tag.get("description") for tag in document["tags"])
    used = {tag for _, _, op in operations(document) for tag in op.get("tags", [])}
    assert used <= set(tags), f"tags missing from the ordered list: {used - set(tags)}"
    first = [path for _, path, _ in operations(document)][:6]
    assert first[0] == "/predict" and "/attention" in first, first
    # every path in the order of its group, as /docs shows them
    groups = [tags.index(op["tags"][0]) for _, _, op in operations(document) if op.get("tags")]
    assert groups == sorted(groups)


def _schema(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """A request body's schema, through a $ref and an optional body's anyOf [..., null]."""
    for option in schema.get("anyOf", []):
        if option.get("type") != "null":
            schema = option
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def test_every_json_request_body_has_an_example(document):
    bodies = 0
    for method, path, op in operations(document):
        content = op.get("requestBody", {}).get("content", {}).get("application/json")
        if content is None:
            continue
        bodies += 1
        examples = content.get("examples") or content.get("example")
        examples = examples or _schema(document, content["schema"]).get("examples")
        assert examples, f"{method} {path}: its JSON body has no example"
    assert bodies >= 10


def test_every_request_body_of_every_encoding_has_an_example(document):
    """Not only JSON: the multipart forms and the protocol's binary tensor bodies too."""
    kinds = set()
    for method, path, op in operations(document):
        for media, content in op.get("requestBody", {}).get("content", {}).items():
            kinds.add(media)
            examples = content.get("examples") or content.get("example")
            examples = examples or _schema(document, content["schema"]).get("examples")
            assert examples, f"{method} {path}: its {media} body has no example"
    assert {"multipart/form-data", "application/octet-stream"} <= kinds
