"""prometheus-client's multiprocess files under ``python -m service``: a full TMPDIR, and the files of
processes that ended.

The files are memory-mapped; made sparse, the first write to a page a full filesystem cannot back
killed the process with SIGBUS (front ends crash-looped). Here each child process makes its metrics on a
tmpfs filled to the brim and must live, count on in memory and say so in its log. The files of an ended
process are folded into archive files: the sums over processes, checked against the amounts the
processes added, stay what they were while the files go.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from service.observability.metrics import ARCHIVE, retire_process
from tests.reliability.full_disk import full_tmpfs
from tests.support import REPO, run_python

MANY_ROUTES = """
from service.observability.metrics import Metrics, exposition

metrics = Metrics()
for route in range(2000):  # about 200 KB of keys: the counter's file grows past its first 64 KiB
    metrics.requests.labels(f"/route/{route}", "GET", "200").inc()
metrics.requests.labels("/route/7", "GET", "200").inc()
print(metrics.requests.labels("/route/7", "GET", "200")._value.get())
exposition(metrics.registry)  # a scrape reads the directory: no file in it may be half made
print("alive")
"""


def python(script: str, metrics_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    return run_python(script, env, *args)


@pytest.mark.parametrize("room_kib", [0, 96], ids=["no room", "room for the first size only"])
def test_a_full_filesystem_leaves_metrics_in_memory_and_the_process_alive(room_kib):
    with full_tmpfs(512, room_kib * 1024) as full:
        done = python(MANY_ROUTES, full)
    assert done.returncode != -signal.SIGBUS, "SIGBUS: a write to a page the filesystem lacked"
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2.0", "alive"], done.stdout  # counted on, in memory
    assert "cannot write to PROMETHEUS_MULTIPROC_DIR (No space left on device)" in done.stderr


def test_each_file_is_reserved_in_full_when_it_is_made_and_grown(tmp_path):
    done = python(MANY_ROUTES, tmp_path)
    assert done.returncode == 0, done.stderr
    (counter,) = tmp_path.glob("counter_*.db")
    size = counter.stat().st_size
    assert size > 64 * 1024  # grown
    assert counter.stat().st_blocks * 512 >= size, "sparse: pages left for a later write to find"


ADDS = """
import os, sys
from service.observability.metrics import Metrics

metrics = Metrics()
amount = int(sys.argv[1])
metrics.requests.labels("/predict", "POST", "200").inc(amount)
metrics.batch_size.labels("tiny-vit", "default").observe(amount)
metrics.queue_depth.labels("tiny-vit", "default").set(amount)  # livesum: the live processes'
metrics.triton["count"].labels("tiny-vit", "1").set(amount)  # sum: every process's, ended too
print(os.getpid())
"""


def sums(metrics_dir: Path) -> dict[str, float | None]:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    value = registry.get_sample_value
    return {
        "requests": value(
            "vitserve_http_requests_total", {"route": "/predict", "method": "POST", "status": "200"}
        ),
        "batches": value("vitserve_batch_size_count", {"model": "tiny-vit", "graph": "default"}),
        "images": value("vitserve_batch_size_sum", {"model": "tiny-vit", "graph": "default"}),
        "triton_count": value("nv_inference_count", {"model": "tiny-vit", "version": "1"}),
        "queue_depth": value("vitserve_queue_depth", {"model": "tiny-vit", "graph": "default"}),
    }


def test_an_ended_process_files_are_folded_into_the_archive_and_its_sums_kept(tmp_path):
    pids = []
    for amount in (5, 7):
        done = python(ADDS, tmp_path, str(amount))
        assert done.returncode == 0, done.stderr
        pids.append(int(done.stdout))
    assert sums(tmp_path) == {
        "requests": 12.0,
        "batches": 2.0,
        "images": 12.0,
        "triton_count": 12.0,
        "queue_depth": 12.0,
    }
    retire_process(pids[0], str(tmp_path))
    assert not list(tmp_path.glob(f"*_{pids[0]}.db"))
    assert sums(tmp_path) == {
        "requests": 12.0,
        "batches": 2.0,
        "images": 12.0,
        "triton_count": 12.0,
        "queue_depth": 7.0,  # only the live process's
    }
    retire_process(pids[1], str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"counter_{ARCHIVE}.db",
        f"gauge_sum_{ARCHIVE}.db",
        f"histogram_{ARCHIVE}.db",
    ]
    assert sums(tmp_path) == {
        "requests": 12.0,
        "batches": 2.0,
        "images": 12.0,
        "triton_count": 12.0,
        "queue_depth": None,
    }
