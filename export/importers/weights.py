"""Reading an untrusted checkpoint: its JSON configs, its weight names and shapes before any tensor,
and the tensors mapped strictly onto ``export/model.py``'s names.

A source module describes its layout as a table (``Layout``): each weight name the checkpoint must
hold, and the slice of the vitserve weight it becomes. The table is complete for the config, so a
missing, an extra or a misshapen weight is refused by its own name before a tensor is read. Pickled
files (``pytorch_model.bin``, ``.pth``) load only through ``torch.load(weights_only=True)``, which
builds tensors and plain containers and refuses every other object.
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from export.checkpoint import CheckpointError
from export.config import ViTConfig

# A config file is a few kilobytes; ImageNet-21k's 21,843 labels are under a megabyte.
MAX_CONFIG_BYTES = 8 << 20
# Objects and arrays within each other: transformers' configs go three deep. Python's json parser
# recurses once a level, and 100,000 levels end in a RecursionError.
MAX_JSON_DEPTH = 32
OPENING, CLOSING = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
# A JSON string: its brackets are text.
JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
# Bounds checked before anything is allocated: beyond ViT-giant (1,408 wide, 40 deep, 16 heads)
# and the largest class lists in use, far below what would exhaust a machine.
LIMITS = {
    "dim": 8192,
    "depth": 128,
    "heads": 256,
    "mlp_dim": 65536,
    "image_side": 4096,
    "patch_size": 1024,
    "num_classes": 100_000,
}
MAX_PARAMETERS = 4_000_000_000
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SAFETENSORS_FLOATS = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class Target:
    """Where a source weight goes: vitserve's ``name``, part ``part`` of ``parts`` along the first
    axis (a query, key or value weight is a third of the fused ``qkv`` weight)."""

    name: str
    part: int = 0
    parts: int = 1


Layout = dict[str, Target]


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in ``text``, counted without parsing it."""
    # UTF-8 encodes no other character with an ASCII byte: the brackets are these bytes alone.
    codes = np.frombuffer(JSON_STRING.sub("", text).encode("utf-8"), dtype=np.uint8)
    steps = np.isin(codes, OPENING).astype(np.int32) - np.isin(codes, CLOSING)
    return int(np.cumsum(steps).max(initial=0))


def read_json(path: Path) -> dict:
    """A JSON object from a file, refused (CheckpointError naming the file) when it is too large,
    nested deeper than ``MAX_JSON_DEPTH``, not JSON or not an object."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read it ({error.strerror or error})") from error
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(
            f"{path}: {size:,} bytes; a config holds at most {MAX_CONFIG_BYTES:,}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise CheckpointError(
            f"{path}: objects and arrays nested {depth:,} deep; a config nests at most "
            f"{MAX_JSON_DEPTH}"
        )
    try:
        document = json.loads(text)
    except ValueError as error:  # JSONDecodeError, or an integer of more digits than int() reads
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return document


def bounded_int(where: str, name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CheckpointError(
            f"{where}: {name} must be an integer in [{low}, {high}], got {value!r}"
        )
    return value


def sides(where: str, name: str, value: object, high: int = 4096) -> tuple[int, int]:
    """(height, width) from a pair or one side of a square, each in [1, high]."""
    if isinstance(value, list | tuple) and len(value) == 2:
        return bounded_int(where, name, value[0], 1, high), bounded_int(
            where, name, value[1], 1, high
        )
    side = bounded_int(where, name, value, 1, high)
    return side, side


def checked_config(where: str, values: dict) -> ViTConfig:
    """A ViTConfig from a source's values, each within ``LIMITS`` and the whole model within
    ``MAX_PARAMETERS``, checked before the model is built."""
    side = LIMITS["image_side"]
    bounded_int(where, "image height", values["image_height"], 1, side)
    bounded_int(where, "image width", values["image_width"], 1, side)
    for name in ("dim", "depth", "heads", "mlp_dim", "patch_size", "num_classes"):
        bounded_int(where, name, values[name], 1, LIMITS[name])
    if values["in_channels"] not in (1, 3):
        raise CheckpointError(
            f"{where}: {values['in_channels']} channels; served: 1 (grey) or 3 (RGB)"
        )
    eps = values.get("layer_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
        raise CheckpointError(f"{where}: layer norm epsilon must be in (0, 1), got {eps!r}")
    try:
        config = ViTConfig(**values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: {error}") from error
    parameters = parameter_count(config)
    if parameters > MAX_PARAMETERS:
        raise CheckpointError(
            f"{where}: the config describes {parameters:,} parameters; at most "
            f"{MAX_PARAMETERS:,} are imported"
        )
    return config


def parameter_count(c: ViTConfig) -> int:
    """The model's parameters, counted from the config alone."""
    block = 4 * c.dim + c.dim * 3 * c.dim + 2 * c.dim * c.mlp_dim + c.mlp_dim + c.dim * c.dim
    block += 3 * c.dim if c.qkv_bias else 0
    embedding = c.dim * (c.in_channels * c.patch_size**2 + 1) + c.dim * (c.num_tokens + 2)
    heads = 2 if c.distillation_token and c.distillation_head else 1
    return c.depth * block + embedding + 2 * c.dim + heads * (c.dim + 1) * c.num_classes


def weight_file(directory: Path) -> Path:
    """``model.safetensors``, else ``pytorch_model.bin``: the names both libraries save under."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return directory / name
    if (directory / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{directory}: sharded checkpoints are not imported; save it whole")
    raise CheckpointError(f"{directory}: holds neither model.safetensors nor pytorch_model.bin")


class Weights:
    """A checkpoint's tensors by name: their shapes and types from the file's header (safetensors)
    or a memory map (a pickled state dict), each tensor read only when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.suffix == ".safetensors":
            try:
                self._handle = safe_open(str(path), framework="pt")
                slices = {name: self._handle.get_slice(name) for name in self._handle.keys()}  # noqa: SIM118
                self.shapes = {name: tuple(view.get_shape()) for name, view in slices.items()}
                self.floating = {
                    name: view.get_dtype() in SAFETENSORS_FLOATS for name, view in slices.items()
                }
            except (SafetensorError, OSError, ValueError) as error:
                raise CheckpointError(f"{path}: not a safetensors file ({error})") from error
            self._state = None
        else:
            self._state = _load_state_dict(path)
            self.shapes = {name: tuple(t.shape) for name, t in self._state.items()}
            self.floating = {name: t.dtype in FLOAT_DTYPES for name, t in self._state.items()}

    def tensor(self, name: str) -> torch.Tensor:
        tensor = self._state[name] if self._state is not None else self._handle.get_tensor(name)
        return tensor.to(torch.float32)


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict through ``torch.load(weights_only=True)``: memory-mapped, or read whole
    when it predates torch's zip format (which cannot be mapped)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        state = _load_pickled(path, mmap=False)
    except (pickle.UnpicklingError, EOFError, OSError, ValueError) as error:
        raise _refused_pickle(path, error) from error
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path}: not a state dict (a mapping of names to tensors)")
    return state


def _load_pickled(path: Path, mmap: bool) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, RuntimeError) as error:
        raise _refused_pickle(path, error) from error


def _refused_pickle(path: Path, error: Exception) -> CheckpointError:
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CheckpointError(
        f"{path}: refused: not a state dict that loads with torch.load(weights_only=True), which "
        f"runs no code from the file ({first})"
    )


def map_weights(
    where: str, weights: Weights, layout: Layout, expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The vitserve state dict from ``weights`` by ``layout``. Every name of the layout must be in
    the file with the shape of its part of ``expected`` (vitserve's shapes), and nothing else;
    this is checked on names and shapes before a tensor is read."""
    missing = [name for name in layout if name not in weights.shapes]
    extra = [name for name in weights.shapes if name not in layout]
    problems = []
    if missing:
        problems.append(f"missing weight(s) {_names(missing)}")
    if extra:
        problems.append(f"unexpected weight(s) {_names(extra)}")
    for name, target in layout.items():
        if name not in weights.shapes:
            continue
        whole = tuple(expected[target.name])
        wanted = (whole[0] // target.parts, *whole[1:])
        if weights.shapes[name] != wanted:
            problems.append(f"{name} has shape {weights.shapes[name]}, expected {wanted}")
        elif not weights.floating[name]:
            problems.append(f"{name} is not a floating-point tensor")
    if problems:
        raise CheckpointError(f"{where}: the weights do not fit the config: " + "; ".join(problems))
    parts: dict[str, list[torch.Tensor]] = {}
    for name, target in sorted(layout.items(), key=lambda item: item[1].part):
        parts.setdefault(target.name, []).append(weights.tensor(name))
    unfilled = sorted(set(expected) - set(parts))
    if unfilled:  # a layout that forgets one of the model's weights is a bug here, not in the file
        raise AssertionError(f"the layout leaves {unfilled} unset")
    return {
        name: torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        for name, tensors in parts.items()
    }


def _names(names: list[str], shown: int = 8) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
