"""The config.pbtxt the export writes is a Triton model configuration that fits its ONNX graph.

Parsed into Triton's own ``ModelConfig`` protobuf (``inference.ModelConfig``, generated code shipped
in tritonclient) with ``google.protobuf.text_format``: an unknown field or a wrong enum fails the parse,
as it fails Triton's. Then checked against the graph Triton's ONNX Runtime backend would load
(``<version>/model.onnx``): names, data types, dims without the batch axis, batching, labels (each
version's own, and the one ``label_filename`` names, relative to the model as Triton reads it).
No Triton server runs here.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

from tests.support import MODEL_NAME, REPO

# ONNX element type -> Triton data type (the ones a ViT classifier uses).
TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.INT64: "TYPE_INT64",
}
SHIPPED = sorted((REPO / "models").glob("*/config.pbtxt"))


def parse(text: str):
    """Strict protobuf text format, as Triton parses it (no vitserve code in between)."""
    return text_format.Parse(text, ModelConfig())


def type_name(value: int) -> str:
    return DataType.Name(value)


def graph_tensors(values) -> list[tuple[str, str, list[int | None]]]:
    """(name, Triton type, dims) of graph inputs or outputs; a symbolic dim is None."""
    tensors = []
    for value in values:
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        tensors.append((value.name, TRITON_TYPES[tensor_type.elem_type], dims))
    return tensors


def check_entry(model_dir: Path) -> None:
    config = parse((model_dir / "config.pbtxt").read_text())
    assert config.name == model_dir.name, "Triton requires the name to match the directory"
    assert config.platform == "onnxruntime_onnx" or config.backend == "onnxruntime"
    assert config.max_batch_size > 0
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds > 0

    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    assert versions, f"{model_dir}: no numbered version directory"
    if config.version_policy.HasField("latest"):
        assert config.version_policy.latest.num_versions >= 1
    filename = config.default_model_filename or "model.onnx"  # the ONNX Runtime backend's default
    for version in versions:
        graph_file = model_dir / str(version) / filename
        model = onnx.load(str(graph_file))
        onnx.checker.check_model(model)
        graph = model.graph
        for kind, declared, actual in (
            ("input", config.input, graph_tensors(graph.input)),
            ("output", config.output, graph_tensors(graph.output)),
        ):
            assert [t.name for t in declared] == [name for name, _, _ in actual], (kind, graph_file)
            for tensor, (name, data_type, dims) in zip(declared, actual, strict=True):
                assert type_name(tensor.data_type) == data_type, (kind, name)
                assert dims[0] is None, f"{graph_file}: {kind} {name} has no dynamic batch axis"
                assert list(tensor.dims) == dims[1:], (kind, name, list(tensor.dims), dims)

    (logits,) = config.output
    assert logits.label_filename, "the classification extension needs label_filename"
    labels_file = model_dir / logits.label_filename  # Triton reads it relative to the model
    assert labels_file.is_file(), labels_file
    assert labels_file.parent.name == str(versions[-1]), "the labels of the version served"
    for version in versions:
        labels = (model_dir / str(version) / "labels.txt").read_text(encoding="utf-8").splitlines()
        assert len(labels) == logits.dims[-1], f"version {version}: one label per class"
        assert all(label.strip() for label in labels)


def test_tiny_exported_config_is_a_triton_model_config(model_repository: Path):
    check_entry(model_repository / MODEL_NAME)


@pytest.mark.parametrize("config_file", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_config_is_a_triton_model_config(config_file: Path):
    check_entry(config_file.parent)


def test_shipped_repository_has_a_model():
    assert SHIPPED, "models/ holds no config.pbtxt"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (("dims:", "dim:"), 'has no field named "dim"'),
        (("TYPE_FP32", "TYPE_FLOAT32"), "TYPE_FLOAT32"),
        (("max_batch_size:", "max_batchsize:"), "max_batchsize"),
    ],
    ids=["unknown-field", "unknown-type", "misspelt"],
)
def test_the_parse_rejects_what_triton_rejects(model_repository: Path, change, error):
    """The check has teeth: a config Triton would refuse fails to parse here too."""
    text = (model_repository / MODEL_NAME / "config.pbtxt").read_text()
    assert change[0] in text
    with pytest.raises(text_format.ParseError, match=error):
        parse(text.replace(change[0], change[1], 1))


def test_check_notices_a_config_that_does_not_fit_the_graph(model_repository: Path, tmp_path):
    """A config whose dims disagree with the graph parses but fails the comparison."""
    entry = tmp_path / MODEL_NAME
    entry.mkdir()
    (entry / "1").symlink_to(model_repository / MODEL_NAME / "1")
    text = (model_repository / MODEL_NAME / "config.pbtxt").read_text()
    assert "dims: [1, 28, 28]" in text
    (entry / "config.pbtxt").write_text(text.replace("dims: [1, 28, 28]", "dims: [3, 28, 28]"))
    with pytest.raises(AssertionError, match="images"):
        check_entry(entry)
