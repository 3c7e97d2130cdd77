"""Class names from a checkpoint's config, made fit to serve."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from export.checkpoint import CheckpointError
from service.contract.model_repository import label_fault, read_labels

MAX_LABEL_CHARS = 1000


class Labels(NamedTuple):
    """A checkpoint's labels, in class order, and where they came from, in words that follow
    "labels" (the export prints it, the model card and the metadata's ``source`` say it)."""

    names: list[str]
    source: str


def servable_label(label: object, index: int, where: str) -> str:
    """``label`` as the service will read it back from labels.txt (``read_labels``: the whitespace
    around it dropped), refused when that is not one label: blank, or holding a line break of any
    kind (``\\v``, ``\\x85``, ``\\u2028`` as well as ``\\n``)."""
    if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
        raise CheckpointError(
            f"{where}: label {index} must be a string of at most {MAX_LABEL_CHARS} characters, "
            f"got {str(label)[:80]!r}"
        )
    lines = read_labels(label)
    if len(lines) != 1:
        raise CheckpointError(
            f"{where}: label {index} {label[:80]!r} cannot be served: {label_fault(label)}"
        )
    return lines[0]


def unique_labels(labels: list[object], where: str) -> list[str]:
    """The labels as the service will read them, each name that repeats told apart by its class
    number (ImageNet's lists name two classes "crane"): the service answers with a label, so each
    must be unique. A name already taken by another class gets a further number."""
    names = [servable_label(label, index, where) for index, label in enumerate(labels)]
    counts = Counter(names)
    taken = {name for name in names if counts[name] == 1}
    unique = []
    for index, name in enumerate(names):
        if counts[name] > 1:
            numbered, tries = f"{name} (class {index})", 1
            while numbered in taken:  # ["a", "a", "a (class 1)"]: class 1 is "a (class 1, 2)"
                tries += 1
                numbered = f"{name} (class {index}, {tries})"
            name = numbered
        taken.add(name)
        unique.append(name)
    return unique
