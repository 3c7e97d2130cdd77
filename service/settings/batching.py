"""Dynamic batching: the overrides of every model's ``config.pbtxt`` and the batcher's own policies.

Each model's batching settings come from its ``config.pbtxt`` (service/contract/model_config.py); the
five overrides here win over every model's file when set.
"""

from __future__ import annotations

from pydantic import Field

from service.contract.limits import LIMITS
from service.settings.group import SettingsGroup


class BatchingSettings(SettingsGroup):
    """The batcher's settings: overrides of config.pbtxt (unset: each model's file decides), the
    attention graph's batch size and idle dispatch."""

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
    attention_max_batch_size: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Most images in one batch of the attention graph (its outputs are much larger).",
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

    def overrides(self) -> dict[str, float | int]:
        """The overrides that are set, in the terms of service.contract.model_config.serving_config."""
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
