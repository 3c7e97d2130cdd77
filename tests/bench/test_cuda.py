"""bench/cuda/, with onnxruntime's CPU provider standing in for the GPU: the model check passes
when the two providers agree, and fails when the device's outputs drift; part 3's servers and the
engine profile's summary."""

from __future__ import annotations

import numpy as np
import pytest

from bench.cuda import check, cli, common, load
from bench.payloads import load_images


@pytest.fixture
def cpu_as_device(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", common.CPU)
    monkeypatch.setattr(common, "DEVICE_SETTING", "cpu")
    monkeypatch.setattr(common, "BATCHES", (2,))


class Drifting:
    """A session whose logits are off by ``scale`` of their norm, as a broken kernel's would be."""

    def __init__(self, session, scale: float):
        self.session, self.scale = session, scale

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, names, feeds):
        outputs = self.session.run(names, feeds)
        noise = np.random.default_rng(0).standard_normal(outputs[0].shape).astype(np.float32)
        noise *= self.scale * np.linalg.norm(outputs[0]) / np.linalg.norm(noise)
        return [outputs[0] + noise, *outputs[1:]]


def test_the_model_check_passes_when_the_providers_agree(cpu_as_device):
    images, _ = load_images(40)
    report = common.Report([], [])
    inputs = check.check_models(report, images, None)
    assert report.failures == []
    assert inputs.shape == (40, 1, 28, 28)
    rows = [line for line in "\n".join(report.lines).splitlines() if line.startswith("| models/")]
    assert len(rows) >= 3 and all(row.rstrip(" |").endswith("pass") for row in rows)


def test_the_model_check_fails_when_the_device_drifts(cpu_as_device, monkeypatch):
    made = check.sessions
    monkeypatch.setattr(
        check, "sessions", lambda path: (made(path)[0], Drifting(made(path)[1], 0.2))
    )
    images, _ = load_images(40)
    report = common.Report([], [])
    check.check_models(report, images, None)
    # every file drifts by 0.2 of its norm: over each limit (1e-2 for fp32, 5e-2 for int8)
    assert len(report.failures) >= 3 and all("on CUDA" in failure for failure in report.failures)
    assert "**FAIL**" in "\n".join(report.lines)


def test_the_relative_error_is_the_norm_of_the_difference_over_the_reference_s():
    reference = np.array([[3.0, 4.0]])
    assert common.relative_error(np.array([[3.0, 4.0]]), reference) == 0
    assert common.relative_error(np.array([[3.0, 5.0]]), reference) == pytest.approx(1 / 5)


def test_part_3_runs_each_cuda_worker_count_then_the_cpu_and_the_plain_server():
    args = cli.parse_args(
        ["--workers", "16,4", "--cpu-workers", "16", "--setting", "max_batch_size=64"]
    )
    servers = load.server_list(args)
    assert [settings for _, settings in servers] == [
        {"provider": "cuda", "workers": 16, "max_batch_size": "64"},
        {"provider": "cuda", "workers": 4, "max_batch_size": "64"},
        {"provider": "cpu", "workers": 16, "max_batch_size": "64"},
        None,
    ]
    assert servers[0][0] == "vitserve, CUDA, 16 workers, max_batch_size=64"
    no_extras = cli.parse_args(["--workers", "1", "--cpu-workers", "0", "--no-plain"])
    assert load.server_list(no_extras) == [
        ("vitserve, CUDA, 1 worker", {"provider": "cuda", "workers": 1})
    ]


def test_the_engine_profile_counts_the_loop_thread_only():
    raw = "\n".join(
        [
            "thread (686): MainThread;run (uvloop/__init__.py:96);_infer (engine_server.py:139) 3",
            "thread (686): MainThread;run (uvloop/__init__.py:96) 1",
            "thread (1017): instance-0;run (onnxruntime/session.py:395) 50",
        ]
    )
    lines = load.loop_frames(raw, top=2)
    assert lines[0] == "- self 75.0%: `_infer (engine_server.py:139)`"
    assert "- within 100.0%: `run (uvloop/__init__.py:96)`" in lines
    assert not any("onnxruntime" in line for line in lines)
