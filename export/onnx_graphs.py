"""The two ONNX graphs of a checkpoint, their verification against PyTorch, and the ``vitserve``
metadata written into them: what ``export.onnx`` (float32) and ``export.quantize`` (int8) share.

Two graphs rather than one graph with two outputs, so that ``/predict`` never assembles and copies
out attention maps it does not return (about 230 KiB an image; on the CPU the difference is within
the machine's noise, BENCHMARKS.md, and on a GPU the maps would cross to the host). Both graphs must
pass the ONNX checker and match PyTorch on real images at batch sizes 1, 7 and 64 (fewer images
where an image is large: ``verify_batch_sizes``); the classifier
is checked against PyTorch's fused forward pass, the attention graph against the explicit one. The
logits may differ by ``LOGITS_TOLERANCE`` of their largest magnitude (at least 1: an absolute 1e-4
for the small logits of vitserve's own models; float32 rounding grows with the logits of a large
imported model), the attention probabilities by ``ATTENTION_TOLERANCE``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export.config import ViTConfig
from export.dataset_spec import FOLDER, DatasetSpec
from export.evaluate import dataset_logits, onnx_runner
from export.model import VisionTransformer, WithAttention
from export.pixels import preprocessing_document
from service.contract.model_repository import Preprocessing, default_input_range

OPSET = 18
METADATA_KEY = "vitserve"
VERIFY_BATCH_SIZES = (1, 7, 64)
# What the verification's images and activations may take (``verification_bytes``): vitserve's own
# models take well under a megabyte an image and are checked on 64; at 224 x 224, ViT-S/16 takes
# about 42 MB (its attention maps, mostly) and is checked on 51, ViT-L/16 on 10 (200 MB); 64 images
# of 3 x 4,096 x 4,096, which the import bounds allow, would take 12.9 GB for their pixels alone.
VERIFY_MEMORY_BYTES = 2 << 30
LOGITS_TOLERANCE = 1e-4
ATTENTION_TOLERANCE = 1e-4


class VerificationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Graphs:
    classifier: onnx.ModelProto
    attention: onnx.ModelProto


def strip_build_details(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop node metadata and doc strings: they hold stack traces with this machine's paths."""

    def clean_graph(graph: onnx.GraphProto) -> None:
        graph.doc_string = ""
        del graph.metadata_props[:]
        for value in [*graph.input, *graph.output, *graph.value_info]:
            value.doc_string = ""
            del value.metadata_props[:]
        for initializer in graph.initializer:
            initializer.doc_string = ""
            del initializer.metadata_props[:]
        for node in graph.node:
            node.doc_string = ""
            del node.metadata_props[:]
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    clean_graph(attribute.g)
                for subgraph in attribute.graphs:
                    clean_graph(subgraph)

    clean_graph(model.graph)
    for function in model.functions:
        function.doc_string = ""
        for node in function.node:
            node.doc_string = ""
            del node.metadata_props[:]
    model.doc_string = ""
    del model.metadata_props[:]
    return model


# The exporter warns about every torchvision op it cannot register; torchvision is not a dependency.
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
# torch 2.13's own decomposition pass deep-copies its LeafSpec objects, whose deprecated constructor
# warns (attributed to copyreg, so no filter on torch's modules catches it); nothing of ours uses
# LeafSpec. Ignored around the export only.
LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def to_onnx(
    module: torch.nn.Module,
    example: torch.Tensor,
    output_names: list[str],
    opset: int = OPSET,
) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            input_names=["images"],
            output_names=output_names,
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
            opset_version=opset,
            external_data=False,
            verbose=False,
        )
    return strip_build_details(program.model_proto)


def example_input(model: VisionTransformer) -> torch.Tensor:
    c = model.config
    return torch.zeros(2, c.in_channels, c.image_height, c.image_width)


def classifier_graph(model: VisionTransformer) -> onnx.ModelProto:
    """``model.onnx``: logits only, exported from the explicit softmax path.

    At opset 18 the exporter spells ``scaled_dot_product_attention`` as the same MatMul-Softmax-MatMul
    plus extra Slice/Reshape/Shape/Concat nodes, which onnxruntime ran slower on the CPU than the
    explicit graph (measured when this was chosen; see the git history of BENCHMARKS.md). Opset 23's
    ``Attention`` op is not taken: onnxruntime's CUDA kernel for it is recent, it could not be checked
    on a GPU here, and Triton servers with an older onnxruntime cannot load opset 23.
    """
    model.eval().set_fused_attention(False)
    try:
        return to_onnx(model, example_input(model), ["logits"])
    finally:
        model.set_fused_attention(True)


def build_graphs(model: VisionTransformer) -> Graphs:
    """The classifier and the attention graph: the same explicit graph, the second one also
    outputting every layer's attention probabilities."""
    attention = to_onnx(WithAttention(model).eval(), example_input(model), ["logits", "attention"])
    return Graphs(classifier_graph(model), attention)


def session_for(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def verification_bytes(config: ViTConfig) -> int:
    """About what one image takes through the verification, in bytes of float32: its pixels (made,
    then fed to PyTorch and to both onnxruntime sessions), one layer's activations (the tokens
    through the MLP, a layer's attention scores and probabilities), and every layer's attention
    maps, which PyTorch (a list, then stacked) and onnxruntime both return."""
    c = config
    tokens = c.num_tokens
    pixels = 4 * c.in_channels * c.image_height * c.image_width
    layer = 2 * tokens * (3 * c.dim + c.mlp_dim) + 2 * c.heads * tokens**2
    maps = 3 * c.depth * c.heads * tokens**2
    return 4 * (pixels + layer + maps)


def verify_batch_sizes(config: ViTConfig) -> tuple[int, ...]:
    """The batch sizes to verify at: ``VERIFY_BATCH_SIZES``, each cut to the images
    ``VERIFY_MEMORY_BYTES`` holds. Two at least, so that a batch of more than one image is
    checked: VerificationError, naming the numbers, when not even two fit."""
    per_image = verification_bytes(config)
    fits = VERIFY_MEMORY_BYTES // per_image
    if fits < 2:
        c = config
        raise VerificationError(
            f"verifying the graphs against PyTorch would take about {per_image / 1e9:,.1f} GB an "
            f"image ({c.in_channels}x{c.image_height}x{c.image_width} pixels, {c.num_tokens:,} "
            f"tokens, {c.depth} layer(s) of {c.heads} head(s) of attention maps); the export holds "
            f"at most {VERIFY_MEMORY_BYTES / 1e9:.1f} GB for two images"
        )
    return tuple(sorted({min(size, fits) for size in VERIFY_BATCH_SIZES}))


# The domain of the nodes onnxruntime's graph optimizer fuses (BiasGelu, FusedMatMul,
# SkipLayerNormalization, ...); its NCHWc layout nodes have a domain of their own and are not counted.
FUSED_DOMAIN = "com.microsoft"


def onnxruntime_fusions(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each fused type onnxruntime's CPU optimizer (``ORT_ENABLE_ALL``, this
    onnxruntime) makes of ``model``: its optimized graph, as written by
    ``SessionOptions.optimized_model_filepath``, counted by type. One session, no inference run."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the warning that an ENABLE_ALL graph is machine-specific
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory(prefix="vitserve-fusions-") as work:
        options.optimized_model_filepath = str(Path(work) / "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    counts = Counter(node.op_type for node in optimized.graph.node if node.domain == FUSED_DOMAIN)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def fusions_text(fusions: dict[str, int] | None) -> str:
    """``BiasGelu x12, FusedMatMul x12``; ``none`` for an empty count."""
    if not fusions:
        return "none"
    return ", ".join(f"{op} x{count}" for op, count in fusions.items())


def verify(model: VisionTransformer, graphs: Graphs, images: torch.Tensor) -> dict:
    """Checker, then onnxruntime against PyTorch at ``verify_batch_sizes``; raises
    VerificationError with the figures."""
    for label, proto in (("model.onnx", graphs.classifier), ("attention.onnx", graphs.attention)):
        try:
            onnx.checker.check_model(proto, full_check=True)
        except onnx.checker.ValidationError as error:
            raise VerificationError(f"{label}: ONNX checker failed: {error}") from error
    classifier, attention = session_for(graphs.classifier), session_for(graphs.attention)
    figures = {}
    failures = []
    for batch_size in verify_batch_sizes(model.config):
        if len(images) < batch_size:
            raise VerificationError(f"need {batch_size} images to verify, got {len(images)}")
        batch = images[:batch_size]
        with torch.inference_mode():
            expected_logits, expected_maps = model.forward_with_attention(batch)
            expected_fused = model(batch)
        feed = {"images": batch.numpy()}
        scale = max(1.0, float(expected_fused.abs().max()))
        (logits,) = classifier.run(["logits"], feed)
        attention_logits, maps = attention.run(["logits", "attention"], feed)
        row = {
            "logits_max_abs_diff": float(np.abs(logits - expected_fused.numpy()).max()),
            "attention_graph_logits_max_abs_diff": float(
                np.abs(attention_logits - expected_logits.numpy()).max()
            ),
            "attention_max_abs_diff": float(np.abs(maps - expected_maps.numpy()).max()),
            "logits_scale": scale,
            "argmax_mismatches": int(
                (logits.argmax(1) != expected_fused.numpy().argmax(1)).sum()
                + (attention_logits.argmax(1) != expected_logits.numpy().argmax(1)).sum()
            ),
        }
        figures[f"batch_{batch_size}"] = row
        beyond = f" (more than {LOGITS_TOLERANCE:g} of their largest magnitude, {scale:.3g})"
        if row["logits_max_abs_diff"] > LOGITS_TOLERANCE * scale:
            failures.append(
                f"batch {batch_size}: logits differ by {row['logits_max_abs_diff']:.3g}{beyond}"
            )
        if row["attention_graph_logits_max_abs_diff"] > LOGITS_TOLERANCE * scale:
            failures.append(
                f"batch {batch_size}: attention graph logits differ by "
                f"{row['attention_graph_logits_max_abs_diff']:.3g}{beyond}"
            )
        if row["attention_max_abs_diff"] > ATTENTION_TOLERANCE:
            failures.append(
                f"batch {batch_size}: attention maps differ by {row['attention_max_abs_diff']:.3g}"
            )
        if row["argmax_mismatches"]:
            failures.append(f"batch {batch_size}: {row['argmax_mismatches']} argmax mismatches")
    if failures:
        raise VerificationError(
            f"ONNX output does not match PyTorch (tolerance {LOGITS_TOLERANCE:g} of the logits' "
            f"scale, {ATTENTION_TOLERANCE:g} for the maps): "
            + "; ".join(failures)
            + f"\nfigures: {json.dumps(figures)}"
        )
    return figures


def measure_accuracy(graph: onnx.ModelProto, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of ``graph`` on ``images``, already normalised."""
    logits = dataset_logits(onnx_runner(session_for(graph)), images.numpy(), lambda x: x, 500)
    return float((logits.argmax(1) == labels.numpy()).mean())


def tool_versions() -> dict:
    import onnxscript

    return {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
        "opset": OPSET,
        "python": sys.version.split()[0],
    }


def describe(
    model: VisionTransformer,
    spec: DatasetSpec,
    labels: list[str],
    name: str,
    version: int,
    graph: str,
    test_accuracy: float | None,
    test_images: int | None,
    checkpoint_sha256: str,
) -> dict:
    """The ``vitserve`` metadata document of a vitserve run's graph. A folder dataset's directory
    is recorded as ``data_dir``, so that ``export.evaluate`` finds its test images."""
    return graph_document(
        model,
        preprocessing_document(spec),
        labels,
        name,
        version,
        graph,
        checkpoint_sha256,
        dataset=spec.name,
        data_dir=spec.default_dir if spec.name == FOLDER else None,
        test_accuracy=test_accuracy,
        test_images=test_images,
    )


def graph_document(
    model: VisionTransformer,
    preprocessing: dict,
    labels: list[str],
    name: str,
    version: int,
    graph: str,
    checkpoint_sha256: str,
    dataset: str | None = None,
    data_dir: str | None = None,
    test_accuracy: float | None = None,
    test_images: int | None = None,
    source: dict | None = None,
) -> dict:
    """The ``vitserve`` metadata document (docs/model-repository.md); ``source`` says where an
    imported checkpoint came from."""
    c = model.config
    document = {
        "format": 1,
        "graph": graph,
        "name": name,
        "version": version,
        "labels": labels,
        "input": {
            "name": "images",
            "layout": "NCHW",
            "dtype": "float32",
            "channels": c.in_channels,
            "height": c.image_height,
            "width": c.image_width,
            "range": list(default_input_range(Preprocessing(**preprocessing))),
        },
        "outputs": {"logits": "logits", "attention": "attention"},
        "preprocessing": preprocessing,
        "patch": {"size": c.patch_size, "grid": list(c.grid)},
        "pooling": c.pooling,
        # Of the attention maps, which leave out the prefix tokens no head pools (config.map_tokens)
        "class_token": c.pooling == "token",
        "tokens": c.map_tokens,
        "depth": c.depth,
        "heads": c.heads,
        "attention_graph": "attention.onnx",
        "dataset": dataset,
        "data_dir": data_dir,
        "test_accuracy": test_accuracy,
        "test_images": test_images,
        "checkpoint_sha256": checkpoint_sha256,
        "model_config": c.description(),
        "tools": tool_versions(),
        "exported_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if source is not None:
        document["source"] = source
    return document


def with_metadata(model: onnx.ModelProto, document: dict) -> onnx.ModelProto:
    """Writes ``document`` into ``model``; a classifier's also records ``onnxruntime_fusions``,
    the nodes onnxruntime fuses in it (:func:`onnxruntime_fusions`), for the model card."""
    if document.get("graph") == "classifier" and "onnxruntime_fusions" not in document:
        document["onnxruntime_fusions"] = onnxruntime_fusions(model)
    onnx.helper.set_model_props(model, {METADATA_KEY: json.dumps(document, sort_keys=True)})
    model.producer_name = "vitserve-export"
    return model
