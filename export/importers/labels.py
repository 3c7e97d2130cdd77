"""Class names from a checkpoint's config, made fit to serve."""

from __future__ import annotations

from collections import Counter

from export.checkpoint import CheckpointError

MAX_LABEL_CHARS = 1000


def unique_labels(labels: list[object], where: str) -> list[str]:
    """The labels as strings, each name that repeats told apart by its class number (ImageNet's
    lists name two classes "crane"): the service answers with a label, so each must be unique."""
    for index, label in enumerate(labels):
        if not isinstance(label, str) or not label.strip() or len(label) > MAX_LABEL_CHARS:
            raise CheckpointError(
                f"{where}: label {index} must be a non-empty string of at most "
                f"{MAX_LABEL_CHARS} characters, got {str(label)[:80]!r}"
            )
        if "\n" in label or "\r" in label:
            raise CheckpointError(f"{where}: label {index} holds a line break")
    counts = Counter(labels)
    return [
        f"{label} (class {i})" if counts[label] > 1 else label for i, label in enumerate(labels)
    ]
