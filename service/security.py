"""Optional API key: ``Authorization: Bearer <key>`` when ``VITSERVE_API_KEY`` is set.

Applied to /predict, /attention and /models; liveness, readiness and metrics stay open. The key is
compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from service.errors import Unauthorized

# Declares the scheme in the OpenAPI document; the header is parsed below to give precise messages.
bearer_scheme = HTTPBearer(auto_error=False, description="The API key, when the service has one.")


async def require_api_key(
    request: Request, _credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)
) -> None:
    check_api_key(request.headers.get("authorization"), request.app.state.settings.api_key)


def check_api_key(header: str | None, api_key: SecretStr | None) -> None:
    """401 unless ``header`` is 'Bearer <api_key>' (always passes when the service has no key); the
    HTTP dependency above and the gRPC service's ``authorization`` metadata share it."""
    if api_key is None:
        return
    if not header:
        raise Unauthorized(
            "this service needs an API key: send the header 'Authorization: Bearer <API key>'"
        )
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer <API key>'")
    if not hmac.compare_digest(token.encode("utf-8"), api_key.get_secret_value().encode("utf-8")):
        raise Unauthorized("the API key in the Authorization header is not valid")
