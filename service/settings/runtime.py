"""onnxruntime's settings: the execution provider and the threads of each session."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from service.settings.group import SettingsGroup


class RuntimeSettings(SettingsGroup):
    """How each onnxruntime session is built: its provider, its device and its threads."""

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
