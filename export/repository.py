"""Write a verified export into the model repository (Triton layout, docs/model-repository.md).

A version is written whole: its files are staged in ``<model>/.staging-<random>/`` (a name no
reader takes for a version: it starts with a dot and is not a number), then renamed to
``<model>/<version>/`` in one step. Its labels are its own (``<version>/labels.txt``). Nothing that
an existing version needs is rewritten; ``config.pbtxt`` (the user's serving settings) is kept, and
only what it lacks is added, written atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

from service.contract.candidate_plan import with_trial
from service.contract.model_config import (
    CONFIG_FILE,
    DataType,
    ModelConfig,
    ModelConfigError,
    default_model_config,
    read_model_config,
    write_model_config,
)
from service.contract.model_repository import (
    LABELS_FILE,
    MAX_VERSION,
    labels_text,
    version_numbers,
)

STAGING_PREFIX = ".staging-"


class RepositoryError(RuntimeError):
    """The export does not fit the model's existing entry (its config.pbtxt or its versions)."""


def labels_path(version: int) -> str:
    """``label_filename`` as Triton reads it: relative to the model's directory."""
    return f"{version}/{LABELS_FILE}"


def _tensors(tensors) -> list[tuple[str, str, list[int]]]:
    return [(t.name, DataType.Name(t.data_type), list(t.dims)) for t in tensors]


def merge_config(existing: ModelConfig | None, new: ModelConfig, newest: bool) -> ModelConfig:
    """The config to keep: ``existing`` with what it lacks taken from ``new``.

    Its inputs and outputs must be those of the new graph (every version of a model takes and
    gives the same tensors). ``label_filename`` names the labels of the newest version, which
    Triton's default policy serves; ``newest`` says whether the version being written is it.
    """
    if existing is None:
        return new
    config = ModelConfig()
    config.CopyFrom(existing)
    if config.name and config.name != new.name:
        raise RepositoryError(
            f"{CONFIG_FILE} names the model {config.name!r}, its directory is {new.name!r}"
        )
    config.name = new.name
    if not config.platform and not config.backend:
        config.platform = new.platform
    if config.max_batch_size < 1:
        config.max_batch_size = new.max_batch_size
    for kind, kept, wanted in (
        ("input", config.input, new.input),
        ("output", config.output, new.output),
    ):
        if not kept:
            kept.extend(wanted)
        elif _tensors(kept) != _tensors(wanted):
            raise RepositoryError(
                f"{CONFIG_FILE} declares {kind} {_tensors(kept)} (name, data type, dims), the new "
                f"graph has {_tensors(wanted)}; export it under another --name, or correct the "
                f"{kind} in {CONFIG_FILE}"
            )
    for output, wanted in zip(config.output, new.output, strict=True):
        if newest or not output.label_filename:
            output.label_filename = wanted.label_filename
    return config


def _stage(staging: Path, graphs: Mapping[str, onnx.ModelProto], labels: str) -> None:
    for filename, graph in graphs.items():
        onnx.save_model(graph, staging / filename)
    (staging / LABELS_FILE).write_text(labels, encoding="utf-8")
    for path in staging.iterdir():
        with open(path, "rb") as file:
            os.fsync(file.fileno())
    staging.chmod(0o755)  # mkdtemp makes it private; the service may run as another user


def checked_version(version: int) -> int:
    """A version number as the repository holds it: 1 to ``MAX_VERSION`` (RepositoryError)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise RepositoryError(
            f"version must be an integer from 1 to {MAX_VERSION} (a signed 64-bit integer, as the "
            f"service and Triton's protocol carry it), got {version!r}"
        )
    return version


def new_version_dir(repo: str | Path, name: str, version: int, overwrite: bool = False) -> Path:
    """``<repo>/<name>/<version>``, which an export is about to write: refused (FileExistsError) when
    it exists, unless ``overwrite``; RepositoryError for a version out of bounds."""
    version_dir = Path(repo) / name / str(checked_version(version))
    if version_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{version_dir} already exists; pass --overwrite to replace it or choose another --version"
        )
    return version_dir


def write_version(
    repo: Path,
    name: str,
    version: int,
    graphs: Mapping[str, onnx.ModelProto],
    labels: Sequence[str],
    input_dims: Sequence[int],
    overwrite: bool = False,
    candidate: bool = False,
) -> Path:
    """Write ``<repo>/<name>/<version>/`` (``graphs`` by file name, and labels.txt) whole, and the
    model's config.pbtxt where there is none or it lacks something: an image classifier taking
    float32 ``images`` of ``input_dims`` (C, H, W) and giving ``logits``, one per label. Labels
    the service would not read back from labels.txt as themselves are refused (RepositoryError).
    ``candidate``: the new version starts as the candidate of the version served now (shadowed on
    every live request, answering none: ``with_trial``); the config says so before the version's
    directory appears, so that a polling service never serves it live first."""
    try:
        text = labels_text(labels)
    except ValueError as error:
        raise RepositoryError(str(error)) from error
    config = default_model_config(
        name, "images", input_dims, len(labels), label_filename=labels_path(version)
    )
    entry = Path(repo) / name
    version_dir = new_version_dir(repo, name, version, overwrite)
    config_path = entry / CONFIG_FILE
    try:
        existing = read_model_config(config_path) if config_path.exists() else None
    except ModelConfigError as error:
        raise RepositoryError(f"{error}; correct it or move it away") from error
    newest = version >= max(version_numbers(entry), default=0)
    wanted = merge_config(existing, config, newest)
    if candidate:
        try:
            wanted = with_trial(wanted, version_numbers(entry), version)
        except ModelConfigError as error:
            raise RepositoryError(f"cannot start a trial: {error}") from None

    entry.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=entry))
    replaced = None
    try:
        _stage(staging, graphs, text)
        if wanted != existing:
            write_model_config(wanted, config_path)
        if version_dir.exists():  # --overwrite: the old version steps aside, then goes
            replaced = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=entry))
            os.rename(version_dir, replaced / "old")
            try:
                os.rename(staging, version_dir)
            except BaseException:  # the new one could not take its place: the old one returns
                os.rename(replaced / "old", version_dir)
                raise
        else:
            os.rename(staging, version_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    return version_dir
