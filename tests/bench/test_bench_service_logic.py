"""The load driver's pure parts: its plan, the /metrics arithmetic, the summaries. No server starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.service import (
    Server,
    ServerSpec,
    batching_counters,
    batching_delta,
    plan,
    summarize_points,
    write_bodies,
)

METRICS = """# HELP vitserve_batch_size Images per model run.
vitserve_batch_size_bucket{graph="classifier",le="1.0"} 3.0
vitserve_batch_size_sum{graph="classifier"} 120.0
vitserve_batch_size_count{graph="classifier"} 10.0
vitserve_batch_size_sum{graph="attention"} 7.0
vitserve_batch_size_count{graph="attention"} 7.0
vitserve_compute_seconds_sum{graph="classifier"} 0.05
vitserve_compute_seconds_count{graph="classifier"} 10.0
vitserve_queue_wait_seconds_sum{graph="classifier"} 0.24
vitserve_queue_wait_seconds_count{graph="classifier"} 120.0
"""


def test_batching_counters_reads_one_graph():
    counters = batching_counters(METRICS)
    assert counters["vitserve_batch_size_sum"] == 120.0
    assert counters["vitserve_batch_size_count"] == 10.0
    assert batching_counters(METRICS, "attention")["vitserve_batch_size_sum"] == 7.0
    assert batching_counters(None) == {}


def test_batching_delta_averages_between_snapshots():
    before = batching_counters(METRICS)
    after = dict(before)
    after["vitserve_batch_size_sum"] += 64
    after["vitserve_batch_size_count"] += 4
    after["vitserve_compute_seconds_sum"] += 0.02
    after["vitserve_queue_wait_seconds_sum"] += 0.128
    after["vitserve_queue_wait_seconds_count"] += 64
    delta = batching_delta(before, after)
    assert delta["batches"] == 4
    assert delta["avg_batch_size"] == 16
    assert abs(delta["avg_compute_ms"] - 5.0) < 1e-9
    assert abs(delta["avg_queue_wait_ms"] - 2.0) < 1e-9
    assert batching_delta(before, before)["avg_batch_size"] is None


def test_plan_uses_the_benchmark_port_range_and_every_case_of_the_issue():
    for quick in (False, True):
        specs, cases = plan(quick, Path("/tmp/ckpt.safetensors"))
        ports = [s.port for s in specs]
        assert len(set(ports)) == len(ports)
        assert all(18100 <= p <= 18199 for p in ports)
        keys = {c.key for c in cases}
        assert {
            "batching",
            "no-batching",
            "baseline",
            "batch32",
            "attention-json",
            "attention-png",
        } <= keys
        servers = {s.key: s for s in specs}
        assert all(c.server in servers for c in cases)
        nobatch = servers["service-nobatch"].env
        assert nobatch["VITSERVE_MAX_BATCH_SIZE"] == "1"
        assert nobatch["VITSERVE_PORT"] == str(servers["service-nobatch"].port)
        assert "--port" in servers["baseline"].argv
    specs, cases = plan(False, Path("/tmp/ckpt.safetensors"))
    main = next(c for c in cases if c.key == "batching")
    assert main.concurrency == [1, 16, 64, 256]


def test_bodies_have_the_api_shapes(tmp_path):
    bodies, _ = write_bodies(tmp_path)
    single = json.loads(bodies["single"].read_text())
    assert len(single["images"]) == 1 and "b64" in single["images"][0]
    assert len(json.loads(bodies["batch32"].read_text())["images"]) == 32
    assert json.loads(bodies["attention_png"].read_text())["format"] == "png"
    assert json.loads(bodies["attention_json"].read_text())["format"] == "json"


def _point(case, level, rps, p99, busy=False, codes=None, batch=None):
    return {
        "case": case,
        "concurrency": level,
        "ok_rps": rps,
        "images_per_s": rps,
        "p50_ms": p99 / 2,
        "p90_ms": p99 * 0.9,
        "p99_ms": p99,
        "not_ok": 0,
        "errors": 0,
        "hey": {"status_codes": codes or {"200": 10}, "errors": {}},
        "busy": {"busy": busy},
        "batching": {"avg_batch_size": batch} if batch else None,
    }


def test_summarize_points_medians_and_busy_counts():
    _, cases = plan(True, Path("/tmp/x"))
    points = [
        _point("batching", 16, 100, 10, batch=8),
        _point("batching", 16, 300, 30, busy=True, codes={"200": 5, "503": 2}, batch=10),
        _point("batching", 16, 200, 20, batch=12),
    ]
    summary = summarize_points(points, cases)["batching"]["levels"]["16"]
    assert summary["ok_rps"]["median"] == 200 and summary["ok_rps"]["min"] == 100
    assert summary["p99_ms"]["max"] == 30
    assert summary["busy_runs"] == 1 and summary["runs"] == 3
    assert summary["status_codes"] == {"200": 25, "503": 2}
    assert summary["avg_batch_size"]["median"] == 10


def test_startup_breakdown_reads_the_service_log_line(tmp_path):
    server = Server(ServerSpec("service", "s", ["true"]), tmp_path)
    assert server.startup_breakdown() is None  # no log yet
    server.log_path.write_text(
        "INFO      vitserve: serving fashion-mnist-vit version 1 from models/fashion-mnist-vit/1 on "
        "CPUExecutionProvider (loaded in 0.31 s, warmed up at batch sizes 1-32 in 0.87 s)\n"
    )
    assert server.startup_breakdown() == {"load_s": 0.31, "warmup_s": 0.87}


def test_a_server_that_dies_before_ready_is_reported_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = Server(ServerSpec("broken", "b", argv, port=18199), tmp_path)
    with pytest.raises(RuntimeError, match="exited with 3 before ready") as error:
        server.start()
    assert "no model here" in str(error.value)
    server.stop()  # nothing left to stop; must not raise
