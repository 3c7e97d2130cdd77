"""Property-based fuzzing of the HTTP API from its own OpenAPI document, with schemathesis.

Every operation in ``/openapi.json`` gets schema-valid and schema-invalid requests (JSON and multipart
bodies, path parameters, headers), a bounded number per operation, in-process through the ASGI app with
its lifespan running. Every response must be free of 5xx and conform to the document: a declared status
code, content type, headers and body schema. An API key is configured, so the fuzzer also checks that
leaving the key out is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.launcher.local_app import local_app
from tests.support import RELIABILITY, make_settings

API_KEY = "fuzz-key"
# Examples per operation: bounded so that CI stays fast; raise it for a deeper run, e.g.
# RELIABILITY_FUZZ_EXAMPLES=500 pytest tests/reliability/test_schemathesis.py
EXAMPLES = int(os.environ.get("RELIABILITY_FUZZ_EXAMPLES", "25"))


# schemathesis 4.32's lazy loader (`schemathesis.pytest.from_fixture`) does not run under pytest 9, so
# the schema is loaded at import time, from the app itself, and bound to it. Creating the app loads
# nothing: only its model repository is unknown until the session fixture has exported the tiny model,
# and the fixture below fills it in before the first request starts the app's lifespan.
APP = local_app(
    make_settings(
        Path("set-by-the-app-fixture"), RELIABILITY, api_key=API_KEY, max_body_bytes=256 * 1024
    )
)
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@pytest.fixture(scope="module", autouse=True)
def app(model_repository) -> Iterator[FastAPI]:
    APP.state.settings.repository.model_repository = model_repository
    yield APP
    asgi.shutdown_lifespans()  # drain and stop the batchers that schemathesis started


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure reproduces locally
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    # positive_data_acceptance expects every schema-valid request to succeed, but a JSON schema cannot
    # say "the base64 of a decodable image": a schema-valid {"b64": "AAAA"} is rightly a 422.
    case.call_and_validate(
        headers={"Authorization": f"Bearer {API_KEY}"},
        excluded_checks=[positive_data_acceptance],
    )
