"""Service settings: every knob is an environment variable with the prefix ``VITSERVE_``.

Each model's batching settings come from its ``config.pbtxt`` (service/contract/model_config.py); the batching
variables here are overrides that win over every model's file when set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.contract.limits import LIMITS


class Settings(BaseSettings):
    """Configuration of the vitserve inference service (environment variables ``VITSERVE_*``)."""

    model_config = SettingsConfigDict(
        env_prefix="VITSERVE_",
        extra="ignore",
        protected_namespaces=(),
        validate_default=True,
    )

    # The models.
    model_repository: Path = Field(
        default=Path("models"),
        description="Directory of the model repository (layout of docs/model-repository.md).",
    )
    models: str | None = Field(
        default=None,
        description=(
            "Comma-separated names of the models to load at start-up, '*' for every model in the "
            "repository; unset: every model, except in 'explicit' model control, where none is "
            "loaded until asked (as Triton's --load-model). Outside 'explicit' mode the models "
            "not named are not served."
        ),
    )
    model_name: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "The default model, served by /predict and /attention; unset: the only model, or the "
            "first by name."
        ),
    )
    model_version: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Pin the default model to this version (overrides its version_policy); unset follows "
            "the policy (by default the highest version)."
        ),
    )
    model_control: Literal["none", "poll", "explicit"] = Field(
        default="none",
        description=(
            "Model control mode, as Triton's: 'none' loads at start-up only; 'poll' also follows the "
            "repository (new, changed and removed versions) every repository_poll_s; 'explicit' loads "
            "and unloads on POST /v2/repository/models/{name}/load|unload."
        ),
    )
    repository_poll_s: float = Field(
        default=5.0,
        gt=0.0,
        le=3600.0,
        description="Seconds between two scans of the repository in 'poll' mode.",
    )

    # Dynamic batching: overrides of every model's config.pbtxt (unset: the file decides).
    max_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=LIMITS["max_batch_size"],
        description="Most images run through the model in one batch (config.pbtxt: max_batch_size).",
    )
    max_queue_delay_ms: float | None = Field(
        default=None,
        ge=0.0,
        le=LIMITS["max_queue_delay_s"] * 1000.0,
        description=(
            "Longest time the oldest queued image waits for a batch to fill before the batch runs anyway "
            "(milliseconds; config.pbtxt: dynamic_batching.max_queue_delay_microseconds)."
        ),
    )
    max_queue_size: int | None = Field(
        default=None,
        ge=1,
        le=LIMITS["max_queue_size"],
        description=(
            "Most images waiting in the queue of a graph; a request that does not fit is answered 503 "
            "with Retry-After at once (config.pbtxt: default_queue_policy.max_queue_size)."
        ),
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0.0,
        le=LIMITS["request_timeout_s"],
        description=(
            "A request not answered within this many seconds of entering the queue gets 503 "
            "(config.pbtxt: default_queue_policy.default_timeout_microseconds)."
        ),
    )
    instance_count: int | None = Field(
        default=None,
        ge=1,
        le=LIMITS["instance_count"],
        description=(
            "Model instances per graph: batches run concurrently, each on its own onnxruntime session "
            "(config.pbtxt: instance_group count)."
        ),
    )
    retry_after_s: int = Field(
        default=1,
        ge=0,
        description="Value of the Retry-After header sent with 503 answers (seconds).",
    )
    attention_max_batch_size: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Most images in one batch of the attention graph (its outputs are much larger).",
    )

    # onnxruntime.
    provider: Literal["auto", "cuda", "cpu"] = Field(
        default="auto",
        description=(
            "Execution provider: 'auto' uses CUDA when onnxruntime has it and falls back to the CPU; "
            "'cuda' fails start-up without it; 'cpu' never uses a GPU."
        ),
    )
    cuda_device_id: int = Field(default=0, ge=0, description="CUDA device the model runs on.")
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = Field(
        default="HEURISTIC",
        description="CUDA provider option cudnn_conv_algo_search (HEURISTIC keeps warm-up short).",
    )
    cuda_mem_limit_bytes: int | None = Field(
        default=None,
        ge=1,
        description="CUDA provider option gpu_mem_limit: most bytes of GPU memory its arena may use.",
    )
    intra_op_threads: int = Field(
        default=0,
        ge=0,
        description=(
            "onnxruntime intra-op threads per session (0: every core but one, shared out among the "
            "instances; the one left runs the event loop)."
        ),
    )
    inter_op_threads: int = Field(
        default=0,
        ge=0,
        description="onnxruntime inter-op threads per session (0 lets onnxruntime choose).",
    )
    allow_spinning: bool = Field(
        default=False,
        description="Let onnxruntime's idle intra-op threads spin for work; off by default, as spinning "
        "threads take CPU from request decoding on small machines (BENCHMARKS.md).",
    )

    # Limits on what a request may carry.
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="Largest request body in bytes; a larger one is answered 413 before it is read.",
    )
    max_images_per_request: int = Field(
        default=64,
        ge=1,
        description="Most images in one /predict request.",
    )
    max_pixels_per_image: int = Field(
        default=4096 * 4096,
        ge=1,
        le=2 * 89_478_485,
        description=(
            "Most pixels (width x height) an image may have; checked from its header before decoding "
            "(at most Pillow's own decompression-bomb limit, 178956970)."
        ),
    )

    max_json_values: int = Field(
        default=1024 * 1024,
        ge=1024,
        description=(
            "Most JSON values (numbers, strings, arrays, objects) a JSON request body may hold, "
            "counted on its raw bytes before it is parsed (each costs about 100 bytes once parsed); "
            "a 1024 x 1024 pixel list is 1.05 million. Larger bodies are answered 413: send large "
            "images as files."
        ),
    )

    max_concurrent_decodes: int = Field(
        default=2,
        ge=1,
        description=(
            "Most requests decoding and preprocessing images at once; bounds the memory that large "
            "images take while decoding (decoding is CPU-bound, so more than the core count gains nothing)."
        ),
    )
    max_decode_waiters: int = Field(
        default=256,
        ge=0,
        description=(
            "Most requests waiting for a decode slot; one more is answered 503 with Retry-After at once."
        ),
    )
    decode_wait_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description="Longest wait for a decode slot before the request is answered 503 with Retry-After.",
    )
    max_pixels_per_request: int = Field(
        default=4 * 4096 * 4096,
        ge=1,
        description=(
            "Most pixels all images of one request may have together, so that one request cannot hold "
            "a decode slot for long."
        ),
    )

    # Access, logging, network.
    api_key: SecretStr | None = Field(
        default=None,
        description=(
            "When set, /predict, /attention and /models need 'Authorization: Bearer <key>'; "
            "health and metrics stay open."
        ),
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info",
        description="Log level of the service and of uvicorn.",
    )
    host: str = Field(default="127.0.0.1", description="Address `python -m service` listens on.")
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        validation_alias=AliasChoices("VITSERVE_PORT", "PORT", "port"),
        description="Port `python -m service` listens on (VITSERVE_PORT, or PORT as platforms set it).",
    )
    idle_dispatch: bool = Field(
        default=True,
        description=(
            "When every instance of the model is idle, run what is queued at once (the requests "
            "of one event-loop turn together; a lone client is not held for partners that will "
            "not come), and what queued during a batch as soon as it ends; false: always wait up "
            "to the queue delay for a fuller batch, as Triton does."
        ),
    )
    workers: int | None = Field(
        default=None,
        ge=0,
        le=256,
        description=(
            "`python -m service`: front-end processes (HTTP and gRPC, decoding), all feeding one "
            "engine process that batches and runs the models; unset: one per usable core; 0: a "
            "single process that runs the engine itself."
        ),
    )
    arena_mib: int = Field(
        default=16,
        ge=1,
        le=4096,
        description=(
            "`python -m service` with front-end processes: shared memory (MiB) each one has for the "
            "rows it hands the engine; rows that do not fit travel inside the message instead."
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
    docs: bool = Field(
        default=True,
        description=(
            "Serve the interactive API docs at /docs (Swagger UI) and /redoc, from assets shipped "
            "with the service (no CDN); /openapi.json is served either way."
        ),
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
    log_format: Literal["text", "json"] = Field(
        default="text",
        description=(
            "'json' writes one JSON object per log line (the service's and uvicorn's, access log "
            "included) with the request id and, when tracing, the trace id."
        ),
    )
    cors_origins: str = Field(
        default="",
        description=(
            "Comma-separated origins that browsers may call the API from (CORS), e.g. "
            "'https://app.example.com'; '*' allows any; empty (the default) sends no CORS headers."
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
    access_log: bool = Field(
        default=False,
        description=(
            "uvicorn's access log, a line per request; off by default, as it costs a share of every "
            "request's CPU (the metrics count every request by route and status)."
        ),
    )

    @model_validator(mode="after")
    def _queue_holds_a_request(self) -> Settings:
        if self.max_queue_size is not None and self.max_queue_size < self.max_images_per_request:
            raise ValueError(
                f"max_queue_size ({self.max_queue_size}) must be at least max_images_per_request "
                f"({self.max_images_per_request}), or a full-sized request could never be queued"
            )
        return self

    @model_validator(mode="after")
    def _grpc_port_follows_the_http_port(self) -> Settings:
        if self.grpc_port is None:
            if self.port == 65535:
                raise ValueError(
                    "grpc_port is unset, so it would be port + 1, and port is 65535: set grpc_port "
                    "(0 turns gRPC off) or a lower port"
                )
            self.grpc_port = self.port + 1
        return self

    @model_validator(mode="after")
    def _health_port_is_its_own(self) -> Settings:
        if self.health_port and self.health_port in (self.port, self.grpc_port):
            raise ValueError(
                f"health_port ({self.health_port}) must differ from port ({self.port}) and "
                f"grpc_port ({self.grpc_port})"
            )
        return self

    @field_validator("models")
    @classmethod
    def _every_model_is_alone(cls, value: str | None) -> str | None:
        names = [name.strip() for name in (value or "").split(",") if name.strip()]
        if "*" in names and len(names) > 1:
            raise ValueError(
                "'*' (every model) cannot be combined with model names, as in Triton's --load-model"
            )
        return value

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
    def front_end_count(self) -> int:
        """Front-end processes: ``workers``, or one per usable core."""
        if self.workers is not None:
            return self.workers
        return (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )

    @property
    def model_list(self) -> list[str]:
        """The names in ``models`` (none for '*')."""
        names = [name.strip() for name in (self.models or "").split(",") if name.strip()]
        return [] if names == ["*"] else names

    @property
    def loads_every_model(self) -> bool:
        """Whether start-up loads every model of the repository: ``models`` is '*', or unset
        outside 'explicit' model control (where, as in Triton's, an unset list loads none)."""
        if self.models is None or not self.models.strip():
            return self.model_control != "explicit"
        return not self.model_list

    @property
    def cors_origin_list(self) -> list[str]:
        return [origin.strip() for origin in self.cors_origins.split(",") if origin.strip()]

    def batching_overrides(self) -> dict[str, float | int]:
        """The batching variables that are set, in the terms of service.contract.model_config.serving_config."""
        values = {
            "max_batch_size": self.max_batch_size,
            "max_queue_delay_s": None
            if self.max_queue_delay_ms is None
            else self.max_queue_delay_ms / 1000.0,
            "max_queue_size": self.max_queue_size,
            "request_timeout_s": self.request_timeout_s,
            "instance_count": self.instance_count,
        }
        return {key: value for key, value in values.items() if value is not None}
