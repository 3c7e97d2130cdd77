"""The server-process helper the benches and the tests share: environment, stopping, readiness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import server_process
from tests.support import MODEL_NAME

PORTS = range(18180, 18190)
# Answers 200 to any GET on the port given as its first argument.
READY_SERVER = (
    "import sys\n"
    "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
    "class Ok(BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200)\n"
    "        self.end_headers()\n"
    "        self.wfile.write(b'ready')\n"
    "HTTPServer(('127.0.0.1', int(sys.argv[1])), Ok).serve_forever()\n"
)

# A parent that starts a child which would outlive it, prints the child's pid, then waits.
PARENT_WITH_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose: it holds no port and no memory.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_clean_env_drops_the_callers_service_settings(monkeypatch):
    monkeypatch.setenv("VITSERVE_MAX_BATCH_SIZE", "1")
    monkeypatch.setenv("PORT", "9999")
    monkeypatch.setenv("HOME_FOR_TEST", "kept")
    env = server_process.clean_env({"VITSERVE_PORT": "18001"})
    assert "VITSERVE_MAX_BATCH_SIZE" not in env and "PORT" not in env
    assert env["VITSERVE_PORT"] == "18001" and env["HOME_FOR_TEST"] == "kept"


def test_service_env_names_its_settings_and_passes_the_provider_through(monkeypatch):
    monkeypatch.setenv("VITSERVE_PROVIDER", "cuda")
    monkeypatch.setenv("VITSERVE_MAX_BATCH_SIZE", "1")
    env = server_process.service_env(18101, intra_op_threads=1, api_key=None)
    assert env["VITSERVE_PORT"] == "18101" and env["VITSERVE_HOST"] == "127.0.0.1"
    assert env["VITSERVE_INTRA_OP_THREADS"] == "1" and env["VITSERVE_PROVIDER"] == "cuda"
    assert "VITSERVE_MAX_BATCH_SIZE" not in env and "VITSERVE_API_KEY" not in env


def test_running_yields_a_ready_server_and_stops_it(tmp_path):
    argv = (sys.executable, "-c", READY_SERVER, "{port}")
    env = lambda port: server_process.clean_env({})  # noqa: E731
    with server_process.running(argv, env, tmp_path / "s.log", ports=PORTS) as server:
        assert server.port in PORTS and server.url.endswith(f":{server.port}")
        assert server_process.http_get(server.url + "/health/ready") == "ready"
        assert 0 < server.ready_s < 60
        process = server.process
    assert process.returncode == -15  # stopped with SIGTERM
    assert server_process.http_get(server.url + "/health/ready", timeout_s=1) is None


def test_running_service_passes_its_settings_to_python_m_service(tmp_path, model_repository):
    settings = {"model_repository": model_repository, "model_name": MODEL_NAME}
    log = tmp_path / "service.log"
    with server_process.running_service(log, ports=PORTS, max_batch_size=3, **settings) as server:
        models = json.loads(server_process.http_get(server.url + "/models") or "{}")
        assert models["models"][0]["name"] == MODEL_NAME
        assert models["models"][0]["batching"]["max_batch_size"] == 3
    assert server.process.returncode == 0  # SIGTERM: a clean shutdown


def test_stop_ends_the_whole_process_group(tmp_path):
    log = tmp_path / "parent.log"
    process = server_process.spawn([sys.executable, "-c", PARENT_WITH_CHILD], os.environ, log)
    try:
        deadline = time.monotonic() + 30
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(log.read_text().split()[0])
        assert alive(child)
    finally:
        server_process.stop_process(process, timeout_s=10)
    assert process.returncode == -15  # SIGTERM, not the SIGKILL fallback
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the child outlived its stopped parent"


def test_a_server_dies_with_the_driver_that_started_it(tmp_path):
    # The driver starts a server and is then killed (SIGKILL: it can clean nothing up itself).
    driver_code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from bench import server_process\n"
        "argv = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        "server = server_process.spawn(argv, os.environ, Path(sys.argv[1]))\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(server_process.REPO)}
    driver = subprocess.Popen(
        [sys.executable, "-c", driver_code, str(tmp_path / "server.log")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server = int(driver.stdout.readline())
        assert alive(server)
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server), "the server outlived the driver that started it"


def test_a_process_that_never_gets_ready_is_reported_with_its_log(tmp_path):
    log = tmp_path / "silent.log"
    argv = [sys.executable, "-c", "print('still loading', flush=True); import time; time.sleep(60)"]
    process = server_process.spawn(argv, os.environ, log)
    port = server_process.free_port(PORTS)
    try:
        with pytest.raises(server_process.ServerStartError, match="not ready within 1 s") as error:
            server_process.wait_ready(process, f"http://127.0.0.1:{port}", log, timeout_s=1)
        assert "still loading" in str(error.value)
    finally:
        server_process.stop_process(process)
