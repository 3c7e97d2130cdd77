"""onnxruntime sessions for one model version: the classifier and the attention graph.

Picks the CUDA execution provider when onnxruntime offers it (unless told otherwise), reports the provider
really in use, checks the graphs against their metadata, and warms both up at every batch size the
batcher will run. ``InferenceSession.run`` is thread-safe and releases the GIL, so batches run in a worker
thread while the event loop keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.model_repository import (
    ModelEntry,
    ModelLoadError,
    ModelMetadata,
    check_entry,
    check_pair,
    find_model,
    parse_metadata,
)
from service.settings import Settings

logger = logging.getLogger("vitserve")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def choose_providers(settings: Settings) -> list[str | tuple[str, dict[str, str]]]:
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


def session_options(settings: Settings) -> ort.SessionOptions:
    """onnxruntime session options for these settings (bench/micro.py varies them one at a time)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = settings.inter_op_threads
    options.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0"
    )
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only; onnxruntime warnings are noise here
    return options


def warm_up_sizes(max_batch_size: int, session: ort.InferenceSession) -> list[int]:
    """Batch sizes to run once before serving.

    On CUDA every size: each new input shape costs a cuDNN/kernel set-up on its first run. On the CPU
    a first run at a new size costs no more than any other run (bench/micro.py measured it), so the
    smallest and largest sizes, which check the graph's batch axis, are enough and start-up is short.
    """
    if session.get_providers()[0] == CUDA:
        return list(range(1, max_batch_size + 1))
    return sorted({1, max_batch_size})


def open_session(path: Path, settings: Settings) -> ort.InferenceSession:
    try:
        session = ort.InferenceSession(
            str(path), sess_options=session_options(settings), providers=choose_providers(settings)
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
    wanted = [meta.outputs.logits] + ([meta.outputs.attention] if graph == "attention" else [])
    for name in wanted:
        if name not in outputs:
            raise ModelLoadError(
                f"{path}: output {name!r} missing; the graph has {sorted(outputs)}"
            )
    classes = outputs[meta.outputs.logits][1:]
    if classes and isinstance(classes[0], int) and classes[0] != meta.num_classes:
        raise ModelLoadError(
            f"{path}: logits have {classes[0]} classes but the metadata lists {meta.num_classes} labels"
        )


@dataclass
class Runtime:
    """Both sessions of one model version, ready to run."""

    entry: ModelEntry
    metadata: ModelMetadata
    classifier: ort.InferenceSession
    attention: ort.InferenceSession
    provider: str
    classifier_batch_sizes: list[int] = field(default_factory=list)
    attention_batch_sizes: list[int] = field(default_factory=list)
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        """Find, open, check and warm up the configured model. Blocking: call it from a thread."""
        started = time.perf_counter()
        entry = find_model(settings.model_repository, settings.model_name, settings.model_version)
        classifier = open_session(entry.classifier_path, settings)
        metadata = parse_metadata(
            classifier.get_modelmeta().custom_metadata_map, entry.classifier_path, "classifier"
        )
        _check_graph(classifier, metadata, entry.classifier_path, "classifier")
        attention = open_session(entry.attention_path, settings)
        attention_metadata = parse_metadata(
            attention.get_modelmeta().custom_metadata_map, entry.attention_path, "attention"
        )
        _check_graph(attention, attention_metadata, entry.attention_path, "attention")
        check_pair(metadata, attention_metadata, entry)
        check_entry(metadata, entry)
        runtime = cls(
            entry=entry,
            metadata=metadata,
            classifier=classifier,
            attention=attention,
            provider=classifier.get_providers()[0],
            classifier_batch_sizes=warm_up_sizes(settings.max_batch_size, classifier),
            attention_batch_sizes=warm_up_sizes(settings.attention_max_batch_size, attention),
        )
        runtime.load_seconds = time.perf_counter() - started
        runtime.warm_up()
        return runtime

    @property
    def input_shape(self) -> tuple[int, int, int]:
        spec = self.metadata.input
        return (spec.channels, spec.height, spec.width)

    def classify(self, images: np.ndarray) -> np.ndarray:
        """Logits ``[batch, classes]`` for a float32 batch ``[batch, C, H, W]``."""
        meta = self.metadata
        (logits,) = self.classifier.run([meta.outputs.logits], {meta.input.name: images})
        return logits

    def attend(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits and attention ``[batch, layers, heads, tokens, tokens]``."""
        meta = self.metadata
        logits, attention = self.attention.run(
            [meta.outputs.logits, meta.outputs.attention], {meta.input.name: images}
        )
        return logits, attention

    def warm_up(self) -> None:
        """Run every batch size once, and check what comes out against the metadata."""
        started = time.perf_counter()
        meta = self.metadata
        rng = np.random.default_rng(0)
        largest = max(self.classifier_batch_sizes + self.attention_batch_sizes)
        images = rng.standard_normal((largest, *self.input_shape), dtype=np.float32)
        tokens = meta.tokens
        try:
            for size in self.classifier_batch_sizes:
                logits = self.classify(images[:size])
                if logits.shape != (size, meta.num_classes):
                    raise ModelLoadError(
                        f"{self.entry.classifier_path}: batch of {size} gave logits {logits.shape}, "
                        f"expected {(size, meta.num_classes)}"
                    )
            expected = (meta.depth, meta.heads, tokens, tokens)
            for size in self.attention_batch_sizes:
                logits, attention = self.attend(images[:size])
                if logits.shape != (size, meta.num_classes) or attention.shape[1:] != expected:
                    raise ModelLoadError(
                        f"{self.entry.attention_path}: batch of {size} gave logits {logits.shape} and "
                        f"attention {attention.shape}, expected {(size, meta.num_classes)} and "
                        f"{(size, *expected)}"
                    )
        except ModelLoadError:
            raise
        except Exception as error:
            raise ModelLoadError(f"{self.entry.directory}: warm-up run failed: {error}") from error
        reference = self.classify(images[:1])
        difference = float(np.max(np.abs(reference - self.attend(images[:1])[0])))
        if difference > 1e-3 * max(1.0, float(np.max(np.abs(reference)))):
            logger.warning(
                "%s and %s disagree on the same input (max logit difference %.3g)",
                self.entry.classifier_path.name,
                self.entry.attention_path.name,
                difference,
            )
        self.warmup_seconds = time.perf_counter() - started
