"""Parts 1 and 2 of ``python -m bench.cuda``: each model file on the device against onnxruntime's CPU
provider, then ``python -m service`` on the device against the same provider in this process.

The device is read from ``bench.cuda.common`` at each call (tests/bench/test_cuda.py makes the CPU
stand in for it)."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.baselines.classifier import Classifier
from bench.cuda import common
from bench.cuda.common import (
    CPU,
    DEFAULT,
    MAX_RELATIVE_ERROR,
    MAX_SCORE_DIFFERENCE,
    MIN_AGREEMENT,
    MODELS,
    PORTS,
    TEST_LABELS,
    Report,
    relative_error,
)
from bench.payloads import DATASET_DIRS, oip_tensor_body, png_bytes, predict_body
from bench.server_process import REPO, SERVICE, running, service_env
from bench.stats import rate, table
from service.contract.model_repository import ATTENTION_FILE, CLASSIFIER_FILE, parse_metadata
from service.contract.preprocessing import Preprocessor


def labels(count: int) -> np.ndarray | None:
    import gzip

    for directory in DATASET_DIRS:
        path = directory / TEST_LABELS
        if path.is_file():
            with gzip.open(path, "rb") as handle:
                return np.frombuffer(handle.read(), np.uint8, offset=8)[:count].astype(np.int64)
    return None


def sessions(path: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    cpu = ort.InferenceSession(path, providers=[CPU])
    cuda = ort.InferenceSession(
        path, providers=[common.DEVICE, CPU] if common.DEVICE != CPU else [CPU]
    )
    if cuda.get_providers()[0] != common.DEVICE:
        raise RuntimeError(f"{path}: onnxruntime fell back to {cuda.get_providers()[0]}")
    return cpu, cuda


def run_all(
    session: ort.InferenceSession, inputs: np.ndarray, chunk: int = 500
) -> list[np.ndarray]:
    name = session.get_inputs()[0].name
    parts = [session.run(None, {name: inputs[i : i + chunk]}) for i in range(0, len(inputs), chunk)]
    return [np.concatenate(outputs) for outputs in zip(*parts, strict=True)]


def check_models(report: Report, images: np.ndarray, truth: np.ndarray | None) -> np.ndarray:
    """Part 1; returns the default model's inputs for the later parts."""
    rows, speed, default_inputs = [], [], None
    for model_dir in sorted(
        d / "1" for d in MODELS.iterdir() if (d / "1" / CLASSIFIER_FILE).is_file()
    ):
        path = model_dir / CLASSIFIER_FILE
        cpu, cuda = sessions(path)
        meta = parse_metadata(cpu.get_modelmeta().custom_metadata_map, path, "classifier")
        pre = Preprocessor(meta, 4096 * 4096)
        inputs = np.stack([pre.from_array(i[:, :, None].astype(np.float32)).tensor for i in images])
        default_inputs = inputs if model_dir == DEFAULT else default_inputs
        (on_cpu,), (on_cuda,) = run_all(cpu, inputs), run_all(cuda, inputs)
        error = relative_error(on_cuda, on_cpu)
        agree = float(np.mean(on_cuda.argmax(1) == on_cpu.argmax(1)))
        accuracy = (
            ""
            if truth is None
            else (
                f"{np.mean(on_cuda.argmax(1) == truth):.4f} / {np.mean(on_cpu.argmax(1) == truth):.4f}"
            )
        )
        limit = MAX_RELATIVE_ERROR.get(meta.precision or "fp32", 1e-2)
        verdict = report.check(error < limit and agree >= MIN_AGREEMENT, f"{path} on CUDA")
        rows.append(
            [
                str(path.relative_to(REPO)),
                f"{error:.2e} (< {limit:g})",
                f"{agree:.4f}",
                accuracy,
                str(meta.test_accuracy),
                verdict,
            ]
        )
        if (model_dir / ATTENTION_FILE).is_file():
            apath = model_dir / ATTENTION_FILE
            acpu, acuda = sessions(apath)
            errors = [
                relative_error(g, r)
                for g, r in zip(
                    run_all(acuda, inputs[:1000]), run_all(acpu, inputs[:1000]), strict=True
                )
            ]
            verdict = report.check(max(errors) < limit, f"{apath} on CUDA")
            rows.append(
                [
                    str(apath.relative_to(REPO)),
                    "outputs: " + ", ".join(f"{e:.2e}" for e in errors),
                    "",
                    "",
                    "",
                    verdict,
                ]
            )
        name = cpu.get_inputs()[0].name
        for batch in common.BATCHES:
            x = inputs[np.arange(batch) % len(inputs)]
            ms = [
                1000 / rate(lambda s=s, n=name, x=x: s.run(None, {n: x}), 1, 0.3)
                for s in (cuda, cpu)
            ]
            speed.append(
                [
                    model_dir.parent.name,
                    str(batch),
                    f"{ms[0]:.3f}",
                    f"{ms[1]:.3f}",
                    f"{batch * 1000 / ms[0]:,.0f}",
                    f"{batch * 1000 / ms[1]:,.0f}",
                ]
            )
    report.lines += [
        "## 1. The model files: CUDA against onnxruntime's CPU provider",
        "",
        f"{len(images):,} test images; relative error ‖cuda - cpu‖ / ‖cpu‖ of the logits; accuracy "
        "CUDA / CPU; the accuracy the export recorded in the file's metadata.",
        "",
        table(["file", "relative error", "top-1 agreement", "accuracy", "metadata", "check"], rows),
        "",
        "Milliseconds per batch (onnxruntime defaults: every core for the CPU provider):",
        "",
        table(["model", "batch", "CUDA ms", "CPU ms", "CUDA images/s", "CPU images/s"], speed),
        "",
    ]
    return default_inputs


def _post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def check_service(report: Report, out: Path, images: np.ndarray) -> None:
    """Part 2: vitserve on CUDA answers what the CPU provider computes."""
    encoded = [base64.b64encode(png_bytes(i)).decode("ascii") for i in images[:32]]
    reference = Classifier(DEFAULT)
    logits = reference.logits(np.stack([reference.tensor(e) for e in encoded]))
    name, meta = DEFAULT.parent.name, reference.metadata
    settings = {"model_repository": MODELS, "provider": common.DEVICE_SETTING, "workers": 2}
    rows = []
    with running(
        SERVICE,
        lambda port: service_env(port, **settings),
        out / "cuda-check.log",
        ports=PORTS,
        name="vitserve on CUDA",
    ) as live:
        info = json.loads(urllib.request.urlopen(f"{live.url}/models/{name}", timeout=10).read())
        rows.append(
            [
                "provider reported",
                info.get("provider"),
                report.check(info.get("provider") == common.DEVICE, "provider reported"),
            ]
        )
        answer = _post(live.url + "/predict", predict_body(encoded, top_k=10))["predictions"]
        worst, same = 0.0, True
        for got, row in zip(answer, logits, strict=True):
            expected = {c["index"]: c["score"] for c in reference.top_k(row, 10)}
            same &= got["index"] == reference.top_k(row, 1)[0]["index"]
            worst = max(worst, *(abs(c["score"] - expected[c["index"]]) for c in got["top_k"]))
        rows.append(
            [
                f"/predict, {len(encoded)} PNGs: largest score difference, same top-1",
                f"{worst:.2e}, {same}",
                report.check(worst < MAX_SCORE_DIFFERENCE and same, "/predict on CUDA"),
            ]
        )
        tensors = np.stack([reference.tensor(e) for e in encoded])
        body = oip_tensor_body(tensors, meta.input.name, meta.outputs.logits)
        output = _post(f"{live.url}/v2/models/{name}/infer", body)["outputs"][0]
        got = np.asarray(output["data"], np.float64).reshape(output["shape"])
        error = relative_error(got, logits)
        rows.append(
            [
                "/v2 infer, FP32 tensors: relative error of the logits",
                f"{error:.2e}",
                report.check(error < MAX_RELATIVE_ERROR["fp32"], "/v2 infer on CUDA"),
            ]
        )
        attention = _post(
            live.url + "/attention", json.dumps({"image": {"b64": encoded[0]}}).encode()
        )
        grid = np.asarray(attention["map"])
        ok = attention["prediction"]["index"] == reference.top_k(logits[0], 1)[0]["index"]
        ok &= grid.shape == tuple(attention["grid"]) and bool(np.isfinite(grid).all())
        rows.append(
            [
                "/attention: same top-1, a finite map of the model's grid",
                str(ok),
                report.check(ok, "/attention on CUDA"),
            ]
        )
    report.lines += [
        "## 2. The service on CUDA",
        "",
        "`VITSERVE_PROVIDER=cuda VITSERVE_WORKERS=2 python -m service`, against "
        "onnxruntime's CPU provider in this process.",
        "",
        table(["check", "measured", "result"], rows),
        "",
    ]
