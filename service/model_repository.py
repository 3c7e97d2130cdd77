"""Find a model in the repository (docs/model-repository.md) and validate its ``vitserve`` metadata.

Everything the service knows about a model comes from here: labels, input spec, preprocessing, patch grid,
pooling, depth and heads. A missing or inconsistent entry raises :class:`ModelLoadError` with a message
that names the file and what is wrong, so start-up stops instead of serving half a model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger("vitserve")

METADATA_KEY = "vitserve"
CLASSIFIER_FILE = "model.onnx"
ATTENTION_FILE = "attention.onnx"


class ModelLoadError(RuntimeError):
    """The model cannot be served; the message says which file and why."""


class _Meta(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), frozen=True)


class InputSpec(_Meta):
    name: str = Field(min_length=1)
    layout: Literal["NCHW"]
    dtype: Literal["float32"]
    channels: Literal[1, 3]
    height: int = Field(ge=1)
    width: int = Field(ge=1)


class Preprocessing(_Meta):
    color: Literal["grayscale", "rgb"]
    resize: Literal["fit-pad"]
    pad_value: float = Field(ge=0, le=255)
    polarity: Literal["light-on-dark", "dark-on-light", "natural"]
    scale: float = Field(gt=0)
    mean: list[float] = Field(min_length=1)
    std: list[float] = Field(min_length=1)


class Patch(_Meta):
    size: int = Field(ge=1)
    grid: tuple[int, int]


class Outputs(_Meta):
    logits: str = "logits"
    attention: str = "attention"


class ModelMetadata(_Meta):
    """The ``vitserve`` JSON document of one graph, checked for internal consistency."""

    format: Literal[1]
    graph: Literal["classifier", "attention"]
    name: str
    version: int
    labels: list[str] = Field(min_length=1)
    input: InputSpec
    outputs: Outputs = Outputs()
    preprocessing: Preprocessing
    patch: Patch
    pooling: Literal["token", "mean"]
    class_token: bool
    tokens: int = Field(ge=1)
    depth: int = Field(ge=1)
    heads: int = Field(ge=1)
    attention_graph: str | None = ATTENTION_FILE
    dataset: str | None = None
    test_accuracy: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelMetadata:
        spec, pre = self.input, self.preprocessing
        expected_color = "grayscale" if spec.channels == 1 else "rgb"
        if pre.color != expected_color:
            raise ValueError(
                f"preprocessing.color {pre.color!r} does not fit input.channels {spec.channels}"
            )
        for key in ("mean", "std"):
            if len(getattr(pre, key)) != spec.channels:
                raise ValueError(
                    f"preprocessing.{key} has {len(getattr(pre, key))} values for {spec.channels} channel(s)"
                )
        if any(s <= 0 for s in pre.std):
            raise ValueError("preprocessing.std values must be positive")
        size = self.patch.size
        if spec.height % size or spec.width % size:
            raise ValueError(
                f"patch.size {size} does not divide the input {spec.height}x{spec.width}"
            )
        grid = (spec.height // size, spec.width // size)
        if tuple(self.patch.grid) != grid:
            raise ValueError(f"patch.grid {list(self.patch.grid)} should be {list(grid)}")
        if self.class_token != (self.pooling == "token"):
            raise ValueError(
                f"class_token {self.class_token} does not fit pooling {self.pooling!r}"
            )
        expected_tokens = grid[0] * grid[1] + (1 if self.class_token else 0)
        if self.tokens != expected_tokens:
            raise ValueError(
                f"tokens {self.tokens} should be {expected_tokens} for this grid and pooling"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels are not unique")
        return self

    @property
    def grid(self) -> tuple[int, int]:
        return (int(self.patch.grid[0]), int(self.patch.grid[1]))

    @property
    def num_classes(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class ModelEntry:
    """Where one version of a model lives in the repository."""

    name: str
    version: int
    directory: Path
    classifier_path: Path
    attention_path: Path
    labels_path: Path


def _versions(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def find_model(repository: Path, name: str, version: int | None = None) -> ModelEntry:
    """The repository entry of ``name`` (highest version unless ``version`` is given)."""
    repository = Path(repository)
    if not repository.is_dir():
        raise ModelLoadError(
            f"model repository {repository} is not a directory (set VITSERVE_MODEL_REPOSITORY)"
        )
    model_dir = repository / name
    if not model_dir.is_dir():
        available = sorted(p.name for p in repository.iterdir() if p.is_dir())
        raise ModelLoadError(
            f"model {name!r} not found in {repository}; available: {', '.join(available) or 'none'} "
            "(set VITSERVE_MODEL_NAME)"
        )
    versions = _versions(model_dir)
    if not versions:
        raise ModelLoadError(
            f"{model_dir} has no numbered version directory (e.g. {model_dir / '1'})"
        )
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise ModelLoadError(
            f"version {version} of model {name!r} not found in {model_dir}; available: "
            f"{', '.join(map(str, versions))} (set VITSERVE_MODEL_VERSION)"
        )
    version_dir = model_dir / str(version)
    entry = ModelEntry(
        name=name,
        version=version,
        directory=version_dir,
        classifier_path=version_dir / CLASSIFIER_FILE,
        attention_path=version_dir / ATTENTION_FILE,
        labels_path=model_dir / "labels.txt",
    )
    for path in (entry.classifier_path, entry.attention_path):
        if not path.is_file():
            raise ModelLoadError(
                f"{path} is missing: every model version needs {CLASSIFIER_FILE} and {ATTENTION_FILE}"
            )
    return entry


def parse_metadata(custom_metadata: dict[str, str], path: Path, graph: str) -> ModelMetadata:
    """Validate the ``vitserve`` JSON of one graph (from ``get_modelmeta().custom_metadata_map``)."""
    raw = custom_metadata.get(METADATA_KEY)
    if raw is None:
        raise ModelLoadError(
            f"{path} has no {METADATA_KEY!r} entry in its ONNX metadata_props; export it with the export stage"
        )
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ModelLoadError(
            f"{path}: the {METADATA_KEY!r} metadata is not valid JSON ({error})"
        ) from error
    try:
        metadata = ModelMetadata.model_validate(document)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'metadata'}: {e['msg']}"
            for e in error.errors()
        )
        raise ModelLoadError(f"{path}: invalid {METADATA_KEY!r} metadata: {problems}") from error
    if metadata.graph != graph:
        raise ModelLoadError(f"{path}: metadata says graph {metadata.graph!r}, expected {graph!r}")
    return metadata


def check_pair(classifier: ModelMetadata, attention: ModelMetadata, entry: ModelEntry) -> None:
    """The two graphs of one version must describe the same model."""
    fields = ("labels", "input", "preprocessing", "patch", "pooling", "tokens", "depth", "heads")
    for field in fields:
        if getattr(classifier, field) != getattr(attention, field):
            raise ModelLoadError(
                f"{entry.attention_path} and {entry.classifier_path} disagree on {field!r}; "
                "re-export both graphs from one checkpoint"
            )


def check_entry(metadata: ModelMetadata, entry: ModelEntry) -> None:
    """labels.txt, where present, must list the metadata's labels in the same order."""
    if metadata.name != entry.name or metadata.version != entry.version:
        logger.warning(
            "%s: metadata names %s version %s; serving it as %s version %s (the repository's names)",
            entry.classifier_path,
            metadata.name,
            metadata.version,
            entry.name,
            entry.version,
        )
    if not entry.labels_path.is_file():
        return
    lines = [line.strip() for line in entry.labels_path.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    if lines != metadata.labels:
        raise ModelLoadError(
            f"{entry.labels_path} ({len(lines)} labels) does not match the labels in the ONNX metadata "
            f"({len(metadata.labels)} labels) of {entry.classifier_path}"
        )
