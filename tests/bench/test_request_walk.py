"""bench/request_walk.py: the hook counts each project function's calls in every thread of a
process (a forked child afresh) and hands them over on a signal; a function is per request only by
what the requests add to an idle window; files are grouped by their job and the walk counts a file
once; and the bench, run for real, finds both ends of the walk in their processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

from bench import request_walk, request_walk_hook
from bench.request_walk import FileCalls, ProcessWalk

CHILD = textwrap.dedent(
    """
    import importlib.util, os, sys, threading, time

    spec = importlib.util.spec_from_file_location("work", sys.argv[1])
    work = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(work)
    for _ in range(5):
        work.f()
    thread = threading.Thread(target=lambda: [work.g() for _ in range(3)])
    thread.start()
    thread.join()
    done, ready = os.pipe()
    child = os.fork()
    if child == 0:
        work.h()
        work.h()
        os.write(ready, b"x")
    else:
        os.read(done, 1)
        print(child, flush=True)
    while True:
        time.sleep(0.01)
    """
)


def test_the_hook_counts_every_thread_and_a_forked_child_starts_afresh(tmp_path):
    project, hook = tmp_path / "project" / "service", tmp_path / "hook"
    project.mkdir(parents=True)
    hook.mkdir()
    (project / "work.py").write_text("def f(): pass\ndef g(): pass\ndef h(): pass\n")
    shutil.copy(request_walk_hook.__file__, hook / "sitecustomize.py")
    env = request_walk.hooked_env(hook, tmp_path / "project", dict(os.environ))
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(project / "work.py")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    try:
        reports = request_walk.take(hook, "window", [parent.pid, child], timeout_s=30)
        again = request_walk.take(hook, "again", [parent.pid], timeout_s=30)
    finally:
        os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()

    def calls(report: dict) -> dict[str, int]:
        counts = request_walk.counts_of(report, tmp_path / "project")
        return {name: n for (file, name, _), n in counts.items() if file == "service/work.py"}

    assert calls(reports[parent.pid]) == {"<module>": 1, "f": 5, "g": 3}
    assert calls(reports[child]) == {"h": 2}
    assert calls(again[parent.pid]) == {}  # each take starts the count afresh


def _walk(requests: dict, idle: dict) -> ProcessWalk:
    return request_walk.walk_of("vitserve-front0", requests, idle, count=10)


def test_a_function_is_per_request_by_what_the_requests_add_to_the_idle_window():
    requests = {
        ("service/frontend/server.py", "Protocol.data_received", 10): 25,
        ("service/link/wire.py", "Link.data_received", 40): 14,  # 10 calls, 4 beats
        ("service/launcher/health.py", "FrontEndBeat.tick", 5): 12,  # beats only
        ("service/frontend/probes.py", "answer", 7): 4,  # fewer than half the requests
        ("service/observability/metrics.py", "Metrics.observe", 3): 10,
        ("service/frontend/error_responses.py", "request_id_of", 9): 10,
    }
    idle = {
        ("service/link/wire.py", "Link.data_received", 40): 4,
        ("service/launcher/health.py", "FrontEndBeat.tick", 5): 11,
    }
    walk = _walk(requests, idle)
    assert walk.on_the_way == [
        FileCalls("service/frontend/server.py", 2.5),
        FileCalls("service/link/wire.py", 1.0),
    ]
    assert walk.beside == {
        "observability": [FileCalls("service/observability/metrics.py", 1.0)],
        "errors": [FileCalls("service/frontend/error_responses.py", 1.0)],
    }
    assert walk.background == ["service/frontend/probes.py", "service/launcher/health.py"]


def test_a_file_s_calls_per_request_add_up_over_its_functions():
    requests = {("service/engine/batcher.py", "a", 1): 20, ("service/engine/batcher.py", "b", 9): 5}
    walk = _walk(requests, {})
    assert walk.on_the_way == [FileCalls("service/engine/batcher.py", 2.5)]


def test_the_walk_counts_a_file_once_over_the_processes_and_leaves_out_what_is_beside_it():
    wire, metrics = FileCalls("service/link/wire.py", 3.0), FileCalls("service/errors.py", 1.0)
    front = ProcessWalk("vitserve-front0", [wire], {"errors": [metrics]}, [])
    engine = ProcessWalk(
        "vitserve-engine", [FileCalls("service/engine/core.py", 1.0), wire], {}, []
    )
    assert request_walk.the_walk([front, engine]) == [
        "service/engine/core.py",
        "service/link/wire.py",
    ]
    text = request_walk.render([front, engine])
    assert "front end (vitserve-front0)" in text and "engine (vitserve-engine)" in text
    assert text.endswith("together: 2 files\n    service/engine/core.py\n    service/link/wire.py")


def test_the_service_s_walk_holds_its_socket_and_its_session_in_their_processes():
    walks = {w.process: w for w in request_walk.measure(request_walk.REPO, 20, workers=1)}
    assert set(walks) == {"vitserve-front0", "vitserve-engine"}
    front = [e.file for e in walks["vitserve-front0"].on_the_way]
    engine = [e.file for e in walks["vitserve-engine"].on_the_way]
    assert "service/frontend/server.py" in front and "service/engine/runtime.py" not in front
    assert "service/engine/runtime.py" in engine and "service/frontend/server.py" not in engine


def test_max_files_is_a_bound_on_the_walk_not_on_each_process():
    front = ProcessWalk("vitserve-front0", [FileCalls("service/link/wire.py", 1.0)], {}, [])
    engine = ProcessWalk(
        "vitserve-engine",
        [FileCalls("service/link/wire.py", 1.0), FileCalls("service/engine/core.py", 1.0)],
        {},
        [],
    )
    assert request_walk.too_long([front, engine], None) is None
    assert request_walk.too_long([front, engine], 2) is None  # wire.py counted once
    assert request_walk.too_long([front, engine], 1) == (
        "the walk holds 2 files, more than --max-files 1"
    )


def test_a_multipart_payload_is_one_image_file_part_to_the_model_s_route():
    payload = request_walk.Payload.multipart("jpeg", "m")
    assert payload.path == "/models/m/predict"
    assert payload.content_type.startswith("multipart/form-data; boundary=")
    assert payload.body.count(b'name="files"; filename="image.jpg"') == 1
    assert b"\xff\xd8\xff" in payload.body  # a JPEG's start of image


# issue 51's target (docs/ARCHITECTURE.md, "A request, from socket to answer")
WALK_BOUND = 20


def test_the_multipart_walk_stays_within_its_bound(capsys):
    argv = ["--multipart", "jpeg", "--requests", "20", "--max-files", str(WALK_BOUND)]
    status = request_walk.main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err + out
    assert "one multipart JPEG file each" in out
    assert "service/engine/model_manager.py" not in out.split("the walk, front end")[1]
