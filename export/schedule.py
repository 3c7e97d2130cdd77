"""The learning-rate schedule every training loop here follows: linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def cosine_learning_rate(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """``peak * (step + 1) / warmup`` during the warm-up, then a cosine from ``peak`` to ``floor``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
