"""The model contract (docs/model-repository.md): file names, the ``vitserve`` metadata, version listing.

Torch-free, so that the service, the export stage and the benchmarks read a model the same way. Any image
classifier with this metadata can be served; the ViT fields (patch grid, pooling, depth, heads, tokens) are
optional and, with an ``attention.onnx`` beside the classifier, enable ``/attention``. A missing or
inconsistent file raises :class:`ModelLoadError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger("vitserve")

METADATA_KEY = "vitserve"
CLASSIFIER_FILE = "model.onnx"
ATTENTION_FILE = "attention.onnx"
LABELS_FILE = "labels.txt"
CONFIG_FILE = "config.pbtxt"
# The largest version number: a version travels as a signed 64-bit integer (Triton's protobufs, the
# process link's msgpack), so a larger one is refused where it enters, and a version directory named
# beyond it is not a version.
MAX_VERSION = 2**63 - 1


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
    # Smallest and largest FP32 element a client may send (/v2 tensors); absent: default_input_range.
    range: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _ordered_range(self) -> InputSpec:
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"input.range {list(self.range)} must be [low, high] with low < high")
        return self


Resample = Literal["nearest", "bilinear", "bicubic", "lanczos", "box"]


class Preprocessing(_Meta):
    """How an image becomes the model's input.

    ``resize`` is the geometry: ``fit-pad`` fits the image inside the input's H x W keeping its aspect
    ratio and pads it centred with ``pad_value`` (vitserve's own runs); ``resize-crop`` resizes the
    shorter side to ``shorter_side`` (the longer side to ``int(shorter_side * long / short)``) and crops
    the centre H x W (timm's ``crop_pct``: ``shorter_side = floor(size / crop_pct)``; Hugging Face's
    ``size.shortest_edge`` with ``crop_size``); ``resize`` scales straight to ``resize_to`` (height,
    width; the input's H x W when absent: Hugging Face's ``size.height`` and ``size.width``) and crops
    the centre H x W of it (Hugging Face's DeiT: 256 x 256, then 224 x 224). ``resample`` names the
    filter of that resize. ``crop_offset`` splits an odd margin of a centre crop: ``floor`` starts the
    crop at ``(h - H) // 2`` (Hugging Face's ``center_crop``), ``round`` at ``round((h - H) / 2)``,
    ties to even (torchvision's ``CenterCrop``, which timm's transforms use).
    """

    color: Literal["grayscale", "rgb"]
    resize: Literal["fit-pad", "resize-crop", "resize"]
    resample: Resample = "bilinear"
    shorter_side: int | None = Field(default=None, ge=1)
    resize_to: tuple[int, int] | None = None
    crop_offset: Literal["floor", "round"] = "floor"
    pad_value: float = Field(default=0.0, ge=0, le=255)
    polarity: Literal["light-on-dark", "dark-on-light", "natural"]
    scale: float = Field(gt=0)
    mean: list[float] = Field(min_length=1)
    std: list[float] = Field(min_length=1)


def preprocessing_range(pre: Preprocessing) -> tuple[float, float]:
    """The smallest and largest value the preprocessing can give: 0 and 255, scaled and normalised."""
    ends = [
        (v * pre.scale - m) / s for m, s in zip(pre.mean, pre.std, strict=True) for v in (0, 255)
    ]
    return min(ends), max(ends)


def default_input_range(pre: Preprocessing) -> tuple[float, float]:
    """The preprocessing's range widened by its own span on each side: what the export records in
    ``input.range`` and what a model without one accepts."""
    low, high = preprocessing_range(pre)
    span = high - low
    return low - span, high + span


class Patch(_Meta):
    size: int = Field(ge=1)
    grid: tuple[int, int]


class Outputs(_Meta):
    logits: str = "logits"
    attention: str = "attention"


class ModelMetadata(_Meta):
    """The ``vitserve`` JSON document of one graph, checked for internal consistency.

    ``patch``, ``pooling``, ``class_token``, ``tokens``, ``depth`` and ``heads`` describe a ViT's token
    grid; they are optional for other classifiers and required (all of them) for attention maps.
    """

    format: Literal[1]
    graph: Literal["classifier", "attention"]
    name: str
    version: int
    labels: list[str] = Field(min_length=1)
    input: InputSpec
    outputs: Outputs = Outputs()
    preprocessing: Preprocessing
    patch: Patch | None = None
    pooling: Literal["token", "mean"] | None = None
    class_token: bool | None = None
    tokens: int | None = Field(default=None, ge=1)
    depth: int | None = Field(default=None, ge=1)
    heads: int | None = Field(default=None, ge=1)
    precision: str = "fp32"
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
        if (pre.resize == "resize-crop") != (pre.shorter_side is not None):
            raise ValueError("preprocessing.shorter_side is given with resize-crop, and only then")
        if pre.shorter_side is not None and pre.shorter_side < max(spec.height, spec.width):
            raise ValueError(
                f"preprocessing.shorter_side {pre.shorter_side} is smaller than the centre crop "
                f"{spec.height}x{spec.width}"
            )
        if pre.resize_to is not None:
            if pre.resize != "resize":
                raise ValueError("preprocessing.resize_to is given with resize, and only then")
            if pre.resize_to[0] < spec.height or pre.resize_to[1] < spec.width:
                raise ValueError(
                    f"preprocessing.resize_to {list(pre.resize_to)} is smaller than the centre crop "
                    f"{spec.height}x{spec.width}"
                )
        if pre.resize == "fit-pad" and pre.crop_offset != "floor":
            raise ValueError("preprocessing.crop_offset is for the centre crop, not fit-pad")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels are not unique")
        if self.patch is not None:
            size = self.patch.size
            if spec.height % size or spec.width % size:
                raise ValueError(
                    f"patch.size {size} does not divide the input {spec.height}x{spec.width}"
                )
            grid = (spec.height // size, spec.width // size)
            if tuple(self.patch.grid) != grid:
                raise ValueError(f"patch.grid {list(self.patch.grid)} should be {list(grid)}")
        if (
            self.class_token is not None
            and self.pooling is not None
            and self.class_token != (self.pooling == "token")
        ):
            raise ValueError(
                f"class_token {self.class_token} does not fit pooling {self.pooling!r}"
            )
        if self.tokens is not None and self.patch is not None and self.class_token is not None:
            grid = self.grid
            expected_tokens = grid[0] * grid[1] + (1 if self.class_token else 0)
            if self.tokens != expected_tokens:
                raise ValueError(
                    f"tokens {self.tokens} should be {expected_tokens} for this grid and pooling"
                )
        if self.graph == "attention" and not self.describes_attention:
            raise ValueError(
                "an attention graph needs patch, pooling, class_token, tokens, depth and heads"
            )
        return self

    @property
    def describes_attention(self) -> bool:
        """Whether the metadata has every field that attention maps need."""
        fields = (self.patch, self.pooling, self.class_token, self.tokens, self.depth, self.heads)
        return all(value is not None for value in fields)

    @property
    def input_range(self) -> tuple[float, float]:
        """The FP32 elements a client may send: ``input.range``, else the default."""
        return self.input.range or default_input_range(self.preprocessing)

    @property
    def grid(self) -> tuple[int, int]:
        if self.patch is None:
            raise ValueError("this model's metadata has no patch grid")
        return (int(self.patch.grid[0]), int(self.patch.grid[1]))

    @property
    def num_classes(self) -> int:
        return len(self.labels)


def rows_fields(metadata: ModelMetadata) -> dict[str, object]:
    """What decides the rows an image becomes, field by field: the rows' C x H x W
    (``input``), ``layout`` and ``dtype``, and every preprocessing field that changes a row.

    Equal in effect, not in text: the input's name and the range a client's tensor may span change
    no row, and every default is spelled out, so metadata written by another export (or before a
    field existed) compares equal when its rows are.
    """
    spec, pre = metadata.input, metadata.preprocessing
    preprocessing = pre.model_dump(mode="json")
    if pre.resize != "fit-pad":
        del preprocessing["pad_value"]  # only fit-pad pads
    shape = f"{spec.channels}x{spec.height}x{spec.width}"
    return {"input": shape, "layout": spec.layout, "dtype": spec.dtype, **preprocessing}


def rows_id(metadata: ModelMetadata) -> int:
    """:func:`rows_fields` as a 63-bit number: two versions with the same id take the same rows. The
    same in every process and every engine started (a digest, not a count assigned at load: a call
    made against one engine's table may reach the next engine after a restart)."""
    text = json.dumps(rows_fields(metadata), sort_keys=True)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class VersionFiles:
    """Where one version of a model lives in the repository."""

    name: str
    version: int
    directory: Path
    classifier_path: Path
    attention_path: Path | None
    labels_path: Path | None

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        """Name, size and modification time of every file the version is served from: a change means
        the version directory was replaced or edited."""
        paths = [self.classifier_path, self.attention_path, self.labels_path]
        return tuple(
            (str(path), stat.st_size, stat.st_mtime_ns)
            for path in paths
            if path is not None
            for stat in [path.stat()]
        )


def version_numbers(model_dir: Path) -> list[int]:
    """The version directories of a model, ascending. Only plain positive integers count, so a
    version being staged under another name (``.staging-*``) is never seen half-written, and none
    beyond :data:`MAX_VERSION`."""
    try:
        children = list(Path(model_dir).iterdir())
    except OSError:
        return []
    return sorted(
        int(p.name.lstrip("0"))  # int() refuses 4,300 digits, zeros included
        for p in children
        if p.is_dir() and p.name.isascii() and p.name.isdigit() and _in_range(p)
    )


_OUT_OF_RANGE: set[Path] = set()  # version directories already warned about


def _in_range(directory: Path) -> bool:
    """A version directory's number is from 1 to :data:`MAX_VERSION`; one beyond it is ignored, with
    one warning (never per poll): it could not travel on the link nor be asked for by a client."""
    digits = directory.name.lstrip("0")
    if not digits:
        return False
    if len(digits) <= len(str(MAX_VERSION)) and int(digits) <= MAX_VERSION:
        return True
    if directory not in _OUT_OF_RANGE:
        _OUT_OF_RANGE.add(directory)
        logger.warning(
            "ignoring the version directory %s of model %r: version numbers go from 1 to %d",
            directory.name[:40] + ("..." if len(directory.name) > 40 else ""),
            directory.parent.name,
            MAX_VERSION,
        )
    return False


def model_names(repository: Path) -> list[str]:
    """Every model in the repository: a directory holding at least one version directory."""
    repository = Path(repository)
    if not repository.is_dir():
        raise ModelLoadError(
            f"model repository {repository} is not a directory (set VITSERVE_MODEL_REPOSITORY)"
        )
    return sorted(
        p.name
        for p in repository.iterdir()
        if p.is_dir() and not p.name.startswith(".") and version_numbers(p)
    )


def version_files(repository: Path, name: str, version: int) -> VersionFiles:
    """The files of one version; :class:`ModelLoadError` when the classifier graph is missing.

    Labels: the version's own ``labels.txt``, else the model's (the layout before labels moved into
    the version). The attention graph is optional.
    """
    model_dir = Path(repository) / name
    directory = model_dir / str(version)
    if not directory.is_dir():
        available = ", ".join(map(str, version_numbers(model_dir))) or "none"
        raise ModelLoadError(
            f"version {version} of model {name!r} not found in {model_dir}; available: {available}"
        )
    classifier = directory / CLASSIFIER_FILE
    if not classifier.is_file():
        raise ModelLoadError(
            f"{classifier} is missing: every model version needs {CLASSIFIER_FILE}"
        )
    attention = directory / ATTENTION_FILE
    labels = next(
        (path for path in (directory / LABELS_FILE, model_dir / LABELS_FILE) if path.is_file()),
        None,
    )
    return VersionFiles(
        name=name,
        version=version,
        directory=directory,
        classifier_path=classifier,
        attention_path=attention if attention.is_file() else None,
        labels_path=labels,
    )


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


def check_pair(classifier: ModelMetadata, attention: ModelMetadata, files: VersionFiles) -> None:
    """The two graphs of one version must describe the same model."""
    fields = ("labels", "input", "preprocessing", "patch", "pooling", "tokens", "depth", "heads")
    for field in fields:
        if getattr(classifier, field) != getattr(attention, field):
            raise ModelLoadError(
                f"{files.attention_path} and {files.classifier_path} disagree on {field!r}; "
                "re-export both graphs from one checkpoint"
            )


def check_labels(metadata: ModelMetadata, files: VersionFiles) -> None:
    """labels.txt, where present, must list the metadata's labels in the same order."""
    if metadata.name != files.name or metadata.version != files.version:
        logger.info(
            "%s: metadata names %s version %s; serving it as %s version %s (the repository's names)",
            files.classifier_path,
            metadata.name,
            metadata.version,
            files.name,
            files.version,
        )
    if files.labels_path is None:
        return
    lines = read_labels(files.labels_path.read_text(encoding="utf-8"))
    if lines != metadata.labels:
        raise ModelLoadError(
            f"{files.labels_path} ({len(lines)} labels) does not match the labels in the ONNX metadata "
            f"({len(metadata.labels)} labels) of {files.classifier_path}"
        )


def read_labels(text: str) -> list[str]:
    """The labels of a labels.txt as the service reads them: one a line, a line ending at every
    break ``str.splitlines`` knows (``\\n``, ``\\r``, and ``\\v``, ``\\f``, ``\\x1c``-``\\x1e``,
    ``\\x85``, ``\\u2028``, ``\\u2029``), without the whitespace around it; blank lines skipped.
    The export writes only labels this reads back as themselves (``labels_text``)."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def label_fault(label: str) -> str | None:
    """Why ``label`` would not read back from labels.txt as itself (``read_labels``), or None."""
    lines = read_labels(label)
    if lines == [label]:
        return None
    if not lines:
        return "it is blank"
    breaks = sorted({f"U+{ord(c):04X}" for c in label if c.splitlines() != [c]})
    if breaks:
        return f"it holds a line break ({', '.join(breaks)})"
    return "it has whitespace around it"


def labels_text(labels: Sequence[str]) -> str:
    """labels.txt of ``labels``, one a line: ValueError naming a label that would not read back as
    itself (``label_fault``), or one that repeats (the service answers with labels)."""
    for index, label in enumerate(labels):
        fault = label_fault(label)
        if fault is not None:
            raise ValueError(
                f"label {index} {label[:80]!r} cannot be written to {LABELS_FILE}: {fault}"
            )
    if len(set(labels)) != len(labels):
        raise ValueError(f"the labels are not unique; {LABELS_FILE} needs one name a class")
    return "".join(f"{label}\n" for label in labels)
