"""What one request may carry and take, and how a refused one is told to come back.

The front ends check them as they admit, decode and queue a request; ``retry_after_s`` is the
Retry-After of every 503 the service answers (front end or engine).
"""

from __future__ import annotations

from pydantic import Field

from service.settings.group import SettingsGroup


class LimitSettings(SettingsGroup):
    """Bounds on a request's body, images, pixels and JSON, on decoding, and the Retry-After of a refusal."""

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
    max_pixels_per_request: int = Field(
        default=4 * 4096 * 4096,
        ge=1,
        description=(
            "Most pixels all images of one request may have together, so that one request cannot hold "
            "a decode slot for long."
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
    jpeg_draft: bool = Field(
        default=True,
        description=(
            "Decode a large JPEG at the smallest of libjpeg's 1/2, 1/4 and 1/8 scales that still "
            "covers the model's resize (faster, less memory); its probabilities differ from a full "
            "decode's by up to about 1e-2 on photos (README). false: every JPEG decoded at full "
            "size, for parity with the source library's own preprocessing."
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
    retry_after_s: int = Field(
        default=1,
        ge=0,
        description="Value of the Retry-After header sent with 503 answers (seconds).",
    )
