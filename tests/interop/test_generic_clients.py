"""Generic Triton clients drive the model from its metadata alone ("Reliability round five").

NVIDIA's perf_analyzer (tritonclient 2.51) fills every input the model metadata lists, optional or
not, with generated data, and stops at start when the configuration lists an input the metadata lacks.
When both declared ``images`` and the image files' ``image``, each of its requests gave both and was
refused. Here requests are built as perf_analyzer builds them, from the metadata and the configuration
over HTTP and gRPC, with tritonclient; and the real perf_analyzer runs when it is installed
(``PERF_ANALYZER``, or ``perf_analyzer`` on the PATH; it needs ``libcudart.so.12``, found beside it in
the nvidia-cuda-runtime-cu12 wheel of its venv or on ``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import triton_to_np_dtype

from tests.support import MODEL_NAME


def generated_inputs(module, metadata: dict, config: dict, batch: int) -> list:
    """The inputs perf_analyzer sends with ``--input-data zero``: one for every input of the
    metadata, zeros of its datatype and shape (the batch in place of -1)."""
    listed = {tensor["name"] for tensor in metadata["inputs"]}
    for tensor in config.get("input", []):  # perf_analyzer: "no metadata found for input tensor"
        assert tensor["name"] in listed, tensor
    inputs = []
    for tensor in metadata["inputs"]:
        shape = [batch if int(size) == -1 else int(size) for size in tensor["shape"]]
        infer_input = module.InferInput(tensor["name"], shape, tensor["datatype"])
        if tensor["datatype"] == "BYTES":
            data = np.full(shape, b"0" * 16, dtype=object)
        else:
            data = np.zeros(shape, triton_to_np_dtype(tensor["datatype"]))
        infer_input.set_data_from_numpy(data)
        inputs.append(infer_input)
    return inputs


@pytest.mark.parametrize("batch", [1, 8])
def test_requests_built_from_the_metadata_as_perf_analyzer_builds_them_are_served(served, batch):
    server, grpc_port = served
    with triton_http.InferenceServerClient(server.url.removeprefix("http://")) as http_client:
        metadata = http_client.get_model_metadata(MODEL_NAME)
        config = http_client.get_model_config(MODEL_NAME)
        inputs = generated_inputs(triton_http, metadata, config, batch)
        over_http = http_client.infer(MODEL_NAME, inputs).as_numpy("logits")
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
        metadata = grpc_client.get_model_metadata(MODEL_NAME, as_json=True)
        config = grpc_client.get_model_config(MODEL_NAME, as_json=True)["config"]
        inputs = generated_inputs(triton_grpc, metadata, config, batch)
        over_grpc = grpc_client.infer(MODEL_NAME, inputs).as_numpy("logits")
    assert over_http.shape == over_grpc.shape == (batch, 10)
    np.testing.assert_array_equal(over_http, over_grpc)  # the same zeros, the same answer


def perf_analyzer() -> tuple[str, dict[str, str]] | None:
    """The perf_analyzer binary and its environment (libcudart.so.12 beside it), or None."""
    binary = os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")
    if not binary:
        return None
    environment = dict(os.environ)
    found = sorted(
        Path(binary).resolve().parents[1].glob("lib/python3*/site-packages/nvidia/*/lib")
    )
    if found:
        paths = [str(path) for path in found] + [environment.get("LD_LIBRARY_PATH", "")]
        environment["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, paths))
    return binary, environment


@pytest.mark.parametrize(("protocol", "batch"), [("http", 1), ("http", 8), ("grpc", 1)])
def test_perf_analyzer_drives_the_model_with_generated_data(served, protocol, batch):
    found = perf_analyzer()
    if found is None:
        pytest.skip("perf_analyzer is not installed (PERF_ANALYZER names it)")
    binary, environment = found
    server, grpc_port = served
    address = f"127.0.0.1:{server.port if protocol == 'http' else grpc_port}"
    command = [binary, "-m", MODEL_NAME, "-u", address, "-i", protocol, "-b", str(batch)]
    # a count of requests, not a time, and any spread accepted: what is checked is that each is served
    command += ["--concurrency-range", "4", "--input-data", "zero", "--measurement-mode"]
    command += ["count_windows", "--measurement-request-count", "40", "-s", "1000", "-r", "6"]
    run = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "error" not in output.lower(), output[-3000:]
    assert "Throughput:" in output, output[-3000:]
