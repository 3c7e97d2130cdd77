"""/docs and /redoc load nothing from another host, and VITSERVE_DOCS=false turns them off."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from service.frontend.docs import CONTENT_SECURITY_POLICY
from service.launcher.local_app import local_app
from tests.support import RELIABILITY, make_settings

EXPECTED_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


class _References(HTMLParser):
    """Every URL an HTML page makes the browser load: src and href attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def references(html: str) -> list[str]:
    parser = _References()
    parser.feed(html)
    return parser.urls


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_only_assets_of_this_server(client, page):
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html, re.IGNORECASE), html
    assert "cdn" not in html.lower() and "fonts.googleapis" not in html
    urls = references(html)
    assert urls, html
    for url in urls:
        assert url.startswith("/docs/assets/"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert asset.headers["content-type"].startswith(EXPECTED_TYPES[url[url.rfind(".") :]])
        assert len(asset.content) > 1000
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY
    assert "'self' http" not in CONTENT_SECURITY_POLICY and "*" not in CONTENT_SECURITY_POLICY


def test_swagger_ui_does_not_call_the_public_validator(client):
    assert '"validatorUrl": null' in client.get("/docs").text


def test_the_docs_can_be_turned_off(model_repository):
    app = local_app(make_settings(model_repository, RELIABILITY, docs=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("/docs", "/redoc", "/docs/assets/swagger-ui-bundle.js"):
            assert client.get(path).status_code == 404, path
        assert client.get("/openapi.json").status_code == 200
