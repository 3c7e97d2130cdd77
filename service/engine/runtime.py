"""onnxruntime sessions for one model version: the classifier (one session per instance) and, when the
version has one, the attention graph.

Picks the CUDA execution provider when onnxruntime offers it (unless told otherwise), reports the provider
really in use, checks the graphs against their metadata, and warms them up at the batch sizes the
batchers will run. ``InferenceSession.run`` releases the GIL, so batches run in worker threads while the
event loop keeps serving.

On the CPU a heavy version's weights are held once (``SharedWeights``): read from the classifier graph,
handed to every classifier instance and to the attention graph as onnxruntime initializers, instead of a
copy per session (three copies of a ViT-B/16's 330 MB with two instances). Those sessions neither
prepack their matrices (each would keep a packed copy of its own) nor keep a memory arena (which holds
the largest batch's activations for good: about 1.5 GB for a ViT-B/16's three sessions). A lighter
model keeps both: its copies cost less, and without prepacking a lone image took 1.04-1.10x as long
(ViT-Ti/16, ViT-S/16 and the toy; BENCHMARKS.md, "One copy of the weights").

On the CPU the batch the batcher may form is measured at load (``batch_cost``): batching where it
saves time per image, one image at a time per instance where it does not.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from service.contract.model_config import ServingConfig
from service.contract.model_repository import (
    ModelLoadError,
    ModelMetadata,
    VersionFiles,
    check_labels,
    check_pair,
    parse_metadata,
)
from service.engine import batch_cost
from service.machine import usable_cores
from service.settings import BatchingSettings, RuntimeSettings

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger("vitserve")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def choose_providers(settings: RuntimeSettings) -> list[str | tuple[str, dict[str, str]]]:
    """The provider list to ask onnxruntime for, CUDA first when it is wanted and offered."""
    if settings.provider == "cpu":
        return [CPU]
    available = ort.get_available_providers()
    if CUDA not in available:
        if settings.provider == "cuda":
            raise ModelLoadError(
                f"VITSERVE_PROVIDER=cuda but this onnxruntime offers only {', '.join(available)}; "
                "install onnxruntime-gpu or set VITSERVE_PROVIDER=auto or cpu"
            )
        return [CPU]
    options = {
        "device_id": str(settings.cuda_device_id),
        "cudnn_conv_algo_search": settings.cudnn_conv_algo_search,
    }
    if settings.cuda_mem_limit_bytes is not None:
        options["gpu_mem_limit"] = str(settings.cuda_mem_limit_bytes)
    return [(CUDA, options), CPU]


def intra_op_threads(settings: RuntimeSettings, instances: int) -> int:
    """The setting when given; else every core but one, shared out among the instances (at least one
    thread each): the one left is the event loop's, which parses, decodes and answers every request
    while the model runs (BENCHMARKS.md measures the alternatives)."""
    if settings.intra_op_threads:
        return settings.intra_op_threads
    return max(1, (usable_cores() - 1) // instances)


# Graphs from this size up share their weights (a ViT-B/16, 330 MB); below it each session keeps its
# own, prepacked (a ViT-S/16, 88 MB: three copies cost 260 MB, and its lone image 4-9% less time).
SHARED_WEIGHTS_FROM_BYTES = 128 * 1024 * 1024


class SharedWeights:
    """A graph's initializers, held once as OrtValues, for every session of the version to take.

    Another graph's initializer is matched by content (type, shape and bytes), not by name: the two
    graphs are exported apart and name the same weight differently (``blocks.0...`` and
    ``model.blocks.0...``), and may reuse a generated name for another constant.
    """

    def __init__(self, path: Path) -> None:
        from onnx import numpy_helper  # only for heavy models: 60 ms of every engine's start-up

        self._values: dict[tuple[int, tuple[int, ...], bytes], tuple[np.ndarray, ort.OrtValue]] = {}
        self.own: dict[str, ort.OrtValue] = {}  # the graph's own initializers, by its names
        self.bytes = 0
        for tensor in _initializers(path):
            array = numpy_helper.to_array(tensor)
            key = _content_key(tensor, array)
            held = self._values.get(key)
            if held is None or not _same_bytes(held[0], array):
                held = (array, ort.OrtValue.ortvalue_from_numpy(array))
                self._values.setdefault(key, held)
                self.bytes += array.nbytes
            self.own[tensor.name] = held[1]

    def matching(self, path: Path) -> dict[str, ort.OrtValue]:
        """The initializers of the graph at ``path`` held here, by that graph's names."""
        from onnx import numpy_helper

        matched = {}
        for tensor in _initializers(path):
            array = numpy_helper.to_array(tensor)
            held = self._values.get(_content_key(tensor, array))
            if held is not None and _same_bytes(held[0], array):
                matched[tensor.name] = held[1]
        return matched


def _initializers(path: Path) -> list[onnx.TensorProto]:
    import onnx

    try:
        return list(onnx.load(str(path)).graph.initializer)
    except Exception as error:  # onnx raises several classes for a bad file
        raise ModelLoadError(f"{path}: cannot read its weights: {error}") from error


def _raw(array: np.ndarray) -> np.ndarray:
    """The array's bytes, without a copy when it is contiguous."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _content_key(tensor: onnx.TensorProto, array: np.ndarray) -> tuple[int, tuple[int, ...], bytes]:
    digest = hashlib.blake2b(_raw(array).data, digest_size=16).digest()
    return (tensor.data_type, tuple(tensor.dims), digest)


def _same_bytes(held: np.ndarray, array: np.ndarray) -> bool:
    return (
        held.shape == array.shape
        and held.dtype == array.dtype
        and bool(np.array_equal(_raw(held), _raw(array)))
    )


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Reading a version's graphs frees hundreds of megabytes of parsed protobuf and warm-up buffers in
    small pieces, which glibc keeps for reuse: without this a ViT-B/16's engine stays hundreds of
    megabytes larger than what it holds (BENCHMARKS.md, "One copy of the weights")."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def session_options(
    settings: RuntimeSettings,
    instances: int = 1,
    initializers: Mapping[str, ort.OrtValue] | None = None,
) -> ort.SessionOptions:
    """onnxruntime session options for these settings and this many instances of a graph, taking
    ``initializers`` (shared with the version's other sessions) instead of the graph's own."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads(settings, instances)
    options.inter_op_num_threads = settings.inter_op_threads
    options.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0"
    )
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only; onnxruntime warnings are noise here
    if initializers:
        options.enable_cpu_mem_arena = False
        options.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in initializers.items():
            options.add_initializer(name, value)
    return options


def warm_up_sizes(max_batch_size: int, session: ort.InferenceSession) -> list[int]:
    """Batch sizes to run once before serving.

    On CUDA every size: each new input shape costs a cuDNN/kernel set-up on its first run. On the CPU
    onnxruntime has no per-shape set-up to hide, so the smallest and largest sizes, which check the
    graph's batch axis, are enough and start-up stays short.
    """
    if session.get_providers()[0] == CUDA:
        return list(range(1, max_batch_size + 1))
    return sorted({1, max_batch_size})


def open_session(
    path: Path,
    settings: RuntimeSettings,
    instances: int = 1,
    initializers: Mapping[str, ort.OrtValue] | None = None,
) -> ort.InferenceSession:
    try:
        session = ort.InferenceSession(
            str(path),
            sess_options=session_options(settings, instances, initializers),
            providers=choose_providers(settings),
        )
    except ModelLoadError:
        raise
    except Exception as error:  # onnxruntime raises several pybind classes for a bad file
        raise ModelLoadError(f"{path}: onnxruntime cannot load this model: {error}") from error
    used = session.get_providers()[0]
    if settings.provider == "cuda" and used != CUDA:
        raise ModelLoadError(
            f"{path}: VITSERVE_PROVIDER=cuda but onnxruntime fell back to {used} "
            "(are the CUDA and cuDNN libraries installed?)"
        )
    return session


def _check_graph(
    session: ort.InferenceSession, meta: ModelMetadata, path: Path, graph: str
) -> None:
    inputs = session.get_inputs()
    spec = meta.input
    if len(inputs) != 1 or inputs[0].name != spec.name:
        names = [i.name for i in inputs]
        raise ModelLoadError(f"{path}: expected one input {spec.name!r}, the graph has {names}")
    shape = list(inputs[0].shape)
    if inputs[0].type != "tensor(float)":
        raise ModelLoadError(
            f"{path}: input {spec.name!r} is {inputs[0].type}, expected tensor(float)"
        )
    if len(shape) != 4 or shape[1:] != [spec.channels, spec.height, spec.width]:
        raise ModelLoadError(
            f"{path}: input shape {shape} does not match the metadata "
            f"[batch, {spec.channels}, {spec.height}, {spec.width}]"
        )
    if isinstance(shape[0], int):
        raise ModelLoadError(
            f"{path}: the batch axis is fixed at {shape[0]}; export it with a dynamic batch axis"
        )
    outputs = {o.name: list(o.shape) for o in session.get_outputs()}
    types = {o.name: o.type for o in session.get_outputs()}
    wanted = [meta.outputs.logits] + ([meta.outputs.attention] if graph == "attention" else [])
    for name in wanted:
        if name not in outputs:
            raise ModelLoadError(
                f"{path}: output {name!r} missing; the graph has {sorted(outputs)}"
            )
        if types[name] != "tensor(float)":  # the whole contract: outputs too
            raise ModelLoadError(
                f"{path}: output {name!r} is {types[name]}, expected tensor(float)"
            )
    classes = outputs[meta.outputs.logits][1:]
    if classes and isinstance(classes[0], int) and classes[0] != meta.num_classes:
        raise ModelLoadError(
            f"{path}: logits have {classes[0]} classes but the metadata lists {meta.num_classes} labels"
        )


@dataclass
class Runtime:
    """The sessions of one model version, ready to run."""

    files: VersionFiles
    metadata: ModelMetadata
    classifiers: list[ort.InferenceSession]
    attention: ort.InferenceSession | None
    provider: str
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    # the weights every session reads (onnxruntime does not copy them: they live as long as the
    # runtime), and how many of the attention graph's initializers are among them
    shared: SharedWeights | None = None
    attention_shared: int = 0
    # the largest batch the classifier's batcher forms, and the measurement that chose it (None: the
    # config's max_batch_size, unmeasured)
    batch_limit: int = 1
    batch_cost: batch_cost.BatchCost | None = None

    @classmethod
    def load(
        cls,
        files: VersionFiles,
        settings: RuntimeSettings,
        serving: ServingConfig,
        batching: BatchingSettings,
    ) -> Runtime:
        """Open, check and warm up one version with the service's runtime settings and batching
        overrides. Blocking: call it from a thread."""
        started = time.perf_counter()
        count = serving.instance_count
        path = files.classifier_path
        heavy = path.stat().st_size >= SHARED_WEIGHTS_FROM_BYTES
        shared = SharedWeights(path) if heavy and choose_providers(settings)[0] == CPU else None
        own = shared.own if shared is not None else None
        first = open_session(path, settings, count, own)
        metadata = parse_metadata(first.get_modelmeta().custom_metadata_map, path, "classifier")
        _check_graph(first, metadata, path, "classifier")
        check_labels(metadata, files)
        classifiers = [first] + [open_session(path, settings, count, own) for _ in range(count - 1)]
        attention, attention_shared = None, {}
        if files.attention_path is not None and metadata.describes_attention:
            if shared is not None:
                attention_shared = shared.matching(files.attention_path)
            attention = open_session(files.attention_path, settings, 1, attention_shared)
            attention_metadata = parse_metadata(
                attention.get_modelmeta().custom_metadata_map, files.attention_path, "attention"
            )
            _check_graph(attention, attention_metadata, files.attention_path, "attention")
            check_pair(metadata, attention_metadata, files)
        runtime = cls(files, metadata, classifiers, attention, first.get_providers()[0])
        runtime.shared = shared
        runtime.attention_shared = len(attention_shared)
        runtime.load_seconds = time.perf_counter() - started
        runtime.warm_up(serving.max_batch_size, batching.attention_max_batch_size)
        runtime.choose_batch_limit(serving, chosen=batching.max_batch_size is not None)
        release_free_memory()
        return runtime

    def choose_batch_limit(self, serving: ServingConfig, chosen: bool = False) -> None:
        """Batch as configured on a GPU, where the config lists its preferred sizes, or where the
        max batch size was ``chosen`` (VITSERVE_MAX_BATCH_SIZE); otherwise, on the CPU, only as far
        as batching measurably saves time per image (``batch_cost``)."""
        self.batch_limit = serving.max_batch_size
        unmeasured = chosen or serving.preferred_batch_sizes or serving.max_batch_size == 1
        if self.provider != CPU or unmeasured:
            return
        started = time.perf_counter()
        images = np.random.default_rng(1).standard_normal(
            (batch_cost.PROBE_BATCH, *self.input_shape), dtype=np.float32
        )
        runners = [self.classify_with(i) for i in range(len(self.classifiers))]
        try:
            self.batch_cost = batch_cost.measure(runners, images)
        except Exception as error:
            raise ModelLoadError(
                f"{self.files.directory}: timing a batch failed: {error}"
            ) from error
        self.batch_limit = self.batch_cost.batch_limit(serving.max_batch_size)
        self.warmup_seconds += time.perf_counter() - started

    @property
    def batching(self) -> str:
        """The batch limit for the load's log line, with the measurement that chose it."""
        cost = self.batch_cost
        if cost is None or cost.batched_ms is None:
            return f"max batch {self.batch_limit}"
        return (
            f"max batch {self.batch_limit} (measured: {cost.lone_ms:.3g} ms an image alone, "
            f"{cost.batched_ms:.3g} ms in a batch of {cost.size})"
        )

    @property
    def input_shape(self) -> tuple[int, int, int]:
        spec = self.metadata.input
        return (spec.channels, spec.height, spec.width)

    def classify(self, images: np.ndarray, instance: int = 0) -> np.ndarray:
        """Logits ``[batch, classes]`` from one instance's session."""
        meta = self.metadata
        (logits,) = self.classifiers[instance].run([meta.outputs.logits], {meta.input.name: images})
        return logits

    def classify_with(self, instance: int) -> Callable[[np.ndarray], tuple[np.ndarray]]:
        """The batch runner of one instance, for the batcher."""
        return lambda images: (self.classify(images, instance),)

    def attend(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits and attention ``[batch, layers, heads, tokens, tokens]``."""
        if self.attention is None:
            raise RuntimeError(f"{self.files.directory} has no attention graph")
        meta = self.metadata
        logits, attention = self.attention.run(
            [meta.outputs.logits, meta.outputs.attention], {meta.input.name: images}
        )
        return logits, attention

    def warm_up(self, max_batch_size: int, attention_max_batch_size: int) -> None:
        """Run the batch sizes the batchers will use once on every session, and check the outputs
        against the metadata."""
        started = time.perf_counter()
        meta = self.metadata
        images = np.random.default_rng(0).standard_normal(
            (max(max_batch_size, attention_max_batch_size), *self.input_shape), dtype=np.float32
        )
        try:
            for instance, session in enumerate(self.classifiers):
                for size in warm_up_sizes(max_batch_size, session):
                    logits = self.classify(images[:size], instance)
                    if logits.shape != (size, meta.num_classes):
                        raise ModelLoadError(
                            f"{self.files.classifier_path}: batch of {size} gave logits "
                            f"{logits.shape}, expected {(size, meta.num_classes)}"
                        )
            if self.attention is not None:
                expected = (meta.depth, meta.heads, meta.tokens, meta.tokens)
                for size in warm_up_sizes(attention_max_batch_size, self.attention):
                    logits, attention = self.attend(images[:size])
                    if logits.shape != (size, meta.num_classes) or attention.shape[1:] != expected:
                        raise ModelLoadError(
                            f"{self.files.attention_path}: batch of {size} gave logits "
                            f"{logits.shape} and attention {attention.shape}, expected "
                            f"{(size, meta.num_classes)} and {(size, *expected)}"
                        )
                reference = self.classify(images[:1])
                difference = float(np.max(np.abs(reference - self.attend(images[:1])[0])))
                if difference > 1e-3 * max(1.0, float(np.max(np.abs(reference)))):
                    logger.warning(
                        "%s and %s disagree on the same input (max logit difference %.3g)",
                        self.files.classifier_path.name,
                        self.files.attention_path.name if self.files.attention_path else "-",
                        difference,
                    )
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(f"{self.files.directory}: warm-up run failed: {error}") from error
        self.warmup_seconds = time.perf_counter() - started
