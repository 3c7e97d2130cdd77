"""The API key's header parsing, beyond what tests/service/test_errors.py and the reliability suite's
route-by-route check cover: what a client may send around the key and still be let in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.launcher.local_app import local_app
from tests.support import assert_error, make_settings

KEY = "k3y-with-no-space"


@pytest.fixture(scope="module")
def keyed(model_repository) -> Iterator[TestClient]:
    with TestClient(local_app(make_settings(model_repository, api_key=KEY))) as client:
        yield client


@pytest.mark.parametrize(
    "header",
    [f"Bearer {KEY}", f"bearer {KEY}", f"Bearer  {KEY}", f"Bearer \t {KEY}", f"  Bearer {KEY}  "],
    ids=["plain", "lower-case scheme", "two spaces", "tab", "padded"],
)
def test_the_key_is_accepted_with_any_whitespace_around_it(keyed, header):
    assert keyed.get("/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (f"Token {KEY}", "must be 'Bearer <API key>'"),
        ("Bearer", "must be 'Bearer <API key>'"),
        (f"{KEY}", "must be 'Bearer <API key>'"),
        (f"Bearer {KEY} {KEY}", "not valid"),
        (f"Bearer {KEY.upper()}", "not valid"),
    ],
    ids=["other scheme", "no key", "no scheme", "key twice", "key in capitals"],
)
def test_anything_else_is_401_saying_what_is_wrong(keyed, header, fragment):
    error = assert_error(keyed.get("/models", headers={"Authorization": header}), 401, fragment)
    assert error["field"] == "Authorization"
