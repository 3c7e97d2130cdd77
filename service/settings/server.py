"""The server around the app: its ports, connections, access, logs, docs, health and shutdown."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator

from service.settings.group import SettingsGroup


class ServerSettings(SettingsGroup):
    """HTTP and gRPC: where the service listens, who may call it, what it logs, how it stops."""

    host: str = Field(default="127.0.0.1", description="Address `python -m service` listens on.")
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        validation_alias=AliasChoices("VITSERVE_PORT", "PORT", "port"),
        description="Port `python -m service` listens on (VITSERVE_PORT, or PORT as platforms set it).",
    )
    grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description=(
            "Port of the gRPC Open Inference Protocol (Triton's GRPCInferenceService, as "
            "tritonclient.grpc speaks it) on the same host; 0 turns gRPC off; unset: the HTTP "
            "port + 1 (8001 by default, as Triton's), so instances given ports two apart never "
            "collide."
        ),
    )
    health_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "`python -m service`: a second port, on the same host, serving only /health/* and "
            "/v2/health/*, answered by the supervisor process (which does no request work) from "
            "what the engine and the front ends report, so that probes are answered at once "
            "however busy the service is; liveness there fails once a process's event loop has "
            "not run for 10 s, readiness follows the engine's. 0 (the default) turns it off; the "
            "container images and the deploy manifests set 8002."
        ),
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=(
            "When set, /predict, /attention and /models need 'Authorization: Bearer <key>'; "
            "health and metrics stay open."
        ),
    )
    cors_origins: str = Field(
        default="",
        description=(
            "Comma-separated origins that browsers may call the API from (CORS), e.g. "
            "'https://app.example.com'; '*' allows any; empty (the default) sends no CORS headers."
        ),
    )
    docs: bool = Field(
        default=True,
        description=(
            "Serve the interactive API docs at /docs (Swagger UI) and /redoc, from assets shipped "
            "with the service (no CDN); /openapi.json is served either way."
        ),
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info",
        description="Log level of the service and of uvicorn.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description=(
            "'json' writes one JSON object per log line (the service's and uvicorn's, access log "
            "included) with the request id and, when tracing, the trace id."
        ),
    )
    access_log: bool = Field(
        default=False,
        description=(
            "uvicorn's access log, a line per request; off by default, as it costs a share of every "
            "request's CPU (the metrics count every request by route and status)."
        ),
    )
    header_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description=(
            "`python -m service`: a connection whose request headers are not complete this many "
            "seconds after it opened (or after its previous response) is answered 408 and closed."
        ),
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description=(
            "`python -m service`: a request body may take this many seconds, plus one second per "
            "body_min_bytes_per_s bytes received; past that it is answered 408 and closed."
        ),
    )
    body_min_bytes_per_s: int = Field(
        default=16 * 1024,
        ge=1,
        description=(
            "`python -m service`: the slowest upload rate (bytes a second) that keeps extending "
            "body_timeout_s; a client at least this fast is never cut off."
        ),
    )
    max_connections: int = Field(
        default=512,
        ge=1,
        description=(
            "`python -m service`: most open client connections (shared out among the front-end "
            "processes); one more is answered 503 with Retry-After and closed, unless it is a GET "
            "of /health/* or /v2/health/*, which is answered."
        ),
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=1024 * 1024,
        description=(
            "`python -m service`: most bytes of a request's line and headers together (at most "
            "1 MiB); more is answered 431 and the connection closed, before the bytes pile up."
        ),
    )
    max_header_count: int = Field(
        default=100,
        ge=8,
        le=1000,
        description=(
            "`python -m service`: most header fields in one request (at most 1000); more is "
            "answered 431 and the connection closed."
        ),
    )
    graceful_shutdown_s: float = Field(
        default=60.0,
        gt=0.0,
        description=(
            "Longest wait for queued and running requests on SIGTERM; what is still unanswered then "
            "is answered 503."
        ),
    )

    @model_validator(mode="after")
    def _grpc_port_follows_the_http_port(self) -> ServerSettings:
        if self.grpc_port is None:
            if self.port == 65535:
                raise ValueError(
                    "grpc_port is unset, so it would be port + 1, and port is 65535: set grpc_port "
                    "(0 turns gRPC off) or a lower port"
                )
            self.grpc_port = self.port + 1
        return self

    @model_validator(mode="after")
    def _health_port_is_its_own(self) -> ServerSettings:
        if self.health_port and self.health_port in (self.port, self.grpc_port):
            raise ValueError(
                f"health_port ({self.health_port}) must differ from port ({self.port}) and "
                f"grpc_port ({self.grpc_port})"
            )
        return self

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key_can_be_sent(cls, value: object) -> object:
        # The messages never quote the key: it is a secret.
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(
                    "api_key is set but empty: unset VITSERVE_API_KEY to serve without a key, "
                    "or give it a value"
                )
            if not all(" " <= char <= "~" for char in value):
                raise ValueError(
                    "api_key must be printable ASCII: an HTTP header cannot carry other "
                    "characters, so no request could ever match it"
                )
            if value != value.strip():
                raise ValueError(
                    "api_key starts or ends with a space, which an Authorization header cannot "
                    "carry, so no request could ever match it"
                )
        return value

    @property
    def cors_origin_list(self) -> list[str]:
        return [origin.strip() for origin in self.cors_origins.split(",") if origin.strip()]
