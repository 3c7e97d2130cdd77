"""KServe's own Python client (``kserve.InferenceRESTClient``, protocol v2) against a real vitserve:
health, model ready, and inference with JSON and with binary tensor data, its numbers checked against
an onnxruntime session this module opens on the model file.

``kserve`` is large (its dependencies add about 240 MB, Kubernetes' client and pandas among them) and
pins versions the shared environment cannot take (python-dateutil < 3, psutil < 6), so it is not in
requirements/dev.txt: requirements/kserve.txt has its pins, and docs/ecosystem.md says how this file is
run. Without ``kserve`` installed, every test here is skipped, saying so.

The client runs in a child process: kserve's protobuf code and tritonclient's (which the service, and
so this process, imports) both define the package ``inference``, and protobuf refuses a second
definition of ``inference.ServerLiveRequest`` in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.interop.eco_support import eco_server, reference_logits, softmax
from tests.support import MODEL_NAME, Reference, Server, run_python

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("kserve") is None,
        reason="kserve is not installed: it is optional (requirements/kserve.txt); "
        "docs/ecosystem.md says how to run this file",
    ),
]

CLIENT = """
import asyncio, json, sys
import httpx
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput

url, model, tensors = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
fp32, pixels = tensors["fp32"], tensors["pixels"]


async def main():
    answers = {}
    async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=30)) as client:
        answers["live"] = await client.is_server_live(url)
        answers["ready"] = await client.is_server_ready(url)
        answers["model_ready"] = await client.is_model_ready(url, model)
        answers["unknown_ready"] = await client.is_model_ready(url, "no-such-model")
        for binary in (False, True):
            infer_input = InferInput("images", list(fp32.shape), "FP32")
            infer_input.set_data_from_numpy(fp32, binary_data=binary)
            request = InferRequest(
                model, [infer_input], request_id=f"kserve-{binary}",
                request_outputs=[
                    RequestedOutput(name, parameters={"binary_data": binary})
                    for name in ("logits", "probabilities")
                ],
            )
            response = await client.infer(url, request, model_name=model)
            answers[f"fp32-{binary}"] = {
                "id": response.id,
                "model_name": response.model_name,
                **{o.name: o.as_numpy().tolist() for o in response.outputs},
            }
        infer_input = InferInput("images", list(pixels.shape), "UINT8")
        infer_input.set_data_from_numpy(pixels, binary_data=True)
        response = await client.infer(url, InferRequest(model, [infer_input]), model_name=model)
        answers["uint8"] = {o.name: o.as_numpy().tolist() for o in response.outputs}
        try:
            await client.infer(url, InferRequest(model, [infer_input]), model_name="resnet50")
        except httpx.HTTPStatusError as error:
            answers["unknown"] = [error.response.status_code, str(error)]
    print(json.dumps(answers))


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def server(model_repository: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("kserve-server") / "service.log"
    with eco_server(model_repository, log, max_queue_delay_ms=20) as (running, _):
        yield running


@pytest.fixture(scope="module")
def answers(server, fashion_images, tmp_path_factory) -> tuple[dict, np.ndarray, np.ndarray]:
    fp32, pixels = Reference.normalise(fashion_images[:5]), fashion_images[5:8]
    tensors = tmp_path_factory.mktemp("kserve-client") / "tensors.npz"
    np.savez(tensors, fp32=fp32, pixels=pixels)
    result = run_python(CLIENT, os.environ, server.url, MODEL_NAME, str(tensors))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), fp32, pixels


def test_health_and_model_ready(answers):
    found, _, _ = answers
    assert (found["live"], found["ready"], found["model_ready"]) == (True, True, True)
    assert found["unknown_ready"] is False


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_fp32_infer_agrees_with_onnxruntime(answers, reference, binary):
    found, fp32, _ = answers
    answer = found[f"fp32-{binary}"]
    assert (answer["model_name"], answer["id"]) == (MODEL_NAME, f"kserve-{binary}")
    expected = reference_logits(reference, fp32)
    assert len(set(np.argmax(expected, axis=1).tolist())) > 1, "the images must differ"
    np.testing.assert_allclose(answer["logits"], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(answer["probabilities"], softmax(expected), rtol=1e-4, atol=1e-6)


def test_uint8_pixels_and_errors(answers, reference):
    found, _, pixels = answers
    np.testing.assert_allclose(
        found["uint8"]["probabilities"], reference.probabilities(pixels), rtol=1e-4, atol=1e-6
    )
    status, message = found["unknown"]
    assert status == 404 and "unknown model 'resnet50'" in message
