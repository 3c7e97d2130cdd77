"""A request's walk, measured: the project files whose code runs for each /predict request, per
process. ``python -m bench.request_walk [--requests 200] [--workers 1] [--checkout PATH]
[--multipart jpeg|png] [--model NAME] [--max-files N]``.

It starts ``python -m service`` as a user does (the checkout's shipped ``models/``, ``--workers`` front
ends), every process of it with ``bench/request_walk_hook.py`` as its ``sitecustomize``: a profiler
that counts the calls of each Python function defined under the checkout's ``service/``, in every
thread (a call: a function entered, or a coroutine or generator resumed). After 50 warm-up requests
it takes three windows, each process's counts read and reset by a signal at each end:

- ``requests``: ``--requests`` POST /predict, one after another on one connection, each one base64
  PNG (a 28x28 Fashion-MNIST image) in /predict's JSON, each answered 200; with ``--multipart jpeg``
  (or ``png``) each is instead one JPEG (PNG) file of that image, a multipart/form-data part named
  ``files``, to ``/models/{--model}/predict`` (the walk issue 51 counts);
- ``idle``: as long again, no request.

A function runs *per request* when the requests window called it at least half as many times as
there were requests more than the idle window did: what timers and heartbeats run alike in both
windows cancels out, and a call the requests cause (each of them goes alone, one batch each) stays.
A file is on the walk when a function of it runs per request. Printed per process (front end,
engine), each file with its calls per request:

- on the request's way, in and back: every such file but those beside it;
- beside it: observability (``service/observability/``: metrics, logs, tracing) and errors
  (``service/errors.py``, ``service/frontend/error_responses.py``);
- background: files whose code ran in the requests window but not per request.

Then the walk: the files on the request's way, front end and engine together, each counted once.
docs/ARCHITECTURE.md ("A request, from socket to answer") quotes it. ``--max-files N`` makes it a
check: the command exits 1, naming the bound, when the walk holds more than ``N`` files
(tests/bench/test_request_walk.py runs it on a short multipart run).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench import request_walk_hook
from bench.machine import descendants
from bench.payloads import b64_pngs, image_file, load_images, multipart_body, predict_body
from bench.server_process import REPO, SERVICE, running, service_env

PORTS = range(18190, 18200)  # the upper half of bench.lone_call's: free_port skips a port in use
WARM_UP = 50
# files beside the request's way, by what they do: a path ending in "/" holds a whole directory
BESIDE = {
    "observability": ("service/observability/",),
    "errors": ("service/errors.py", "service/frontend/error_responses.py"),
}
ROLES = {"vitserve-engine": "engine", "vitserve-front": "front end"}
MODEL = "fashion-mnist-vit"  # the shipped model /models/{name}/predict names by default
FILE_KINDS = {"jpeg": ("JPEG", "image.jpg"), "png": ("PNG", "image.png")}  # --multipart's

# one function of one process: (file relative to the checkout, qualified name, first line)
Function = tuple[str, str, int]


@dataclass(frozen=True)
class Payload:
    """What each request of a run is: its path, body and Content-Type, and how the report says it."""

    path: str
    body: bytes
    content_type: str
    described: str

    @classmethod
    def json_png(cls) -> Payload:
        body = predict_body(b64_pngs(1)[0])
        return cls("/predict", body, "application/json", "POST /predict, one base64 PNG each")

    @classmethod
    def multipart(cls, kind: str, model: str = MODEL) -> Payload:
        """One ``kind`` file (``FILE_KINDS``) of a Fashion-MNIST image, a part named ``files``."""
        form, name = FILE_KINDS[kind]
        body, content_type = multipart_body([(name, image_file(load_images(1)[0][0], form))])
        described = f"POST /models/{model}/predict, one multipart {form} file each"
        return cls(f"/models/{model}/predict", body, content_type, described)


@dataclass(frozen=True)
class FileCalls:
    file: str
    calls_per_request: float


@dataclass(frozen=True)
class ProcessWalk:
    process: str  # its name, as ps shows it
    on_the_way: list[FileCalls]
    beside: dict[str, list[FileCalls]]  # by BESIDE's kinds
    background: list[str]


def role(process: str) -> str:
    """'engine' or 'front end' for the service's processes' names, else the name itself."""
    return next((r for prefix, r in ROLES.items() if process.startswith(prefix)), process)


def beside_kind(file: str) -> str | None:
    """The kind of work beside the request's way a file does (BESIDE), or None for one on it."""
    for kind, places in BESIDE.items():
        if any(file.startswith(p) if p.endswith("/") else file == p for p in places):
            return kind
    return None


def counts_of(report: Mapping, root: Path) -> dict[Function, int]:
    """A hook report's calls per function, with files relative to ``root`` (the checkout)."""
    return {
        (str(Path(f["file"]).relative_to(root)), f["function"], f["line"]): f["calls"]
        for f in report["functions"]
    }


def walk_of(
    process: str, requests: Mapping[Function, int], idle: Mapping[Function, int], count: int
) -> ProcessWalk:
    """One process's files, sorted: per request (a function called at least ``count / 2`` more times
    in the requests window than in the idle window), grouped; the rest that ran, background."""
    per_request: dict[str, float] = {}
    ran = {file for file, _, _ in requests}
    for function, calls in requests.items():
        extra = calls - idle.get(function, 0)
        if extra >= count / 2:
            file = function[0]
            per_request[file] = per_request.get(file, 0.0) + extra / count
    on_the_way: list[FileCalls] = []
    beside: dict[str, list[FileCalls]] = {kind: [] for kind in BESIDE}
    for file in sorted(per_request):
        entry = FileCalls(file, per_request[file])
        kind = beside_kind(file)
        (on_the_way if kind is None else beside[kind]).append(entry)
    return ProcessWalk(process, on_the_way, beside, sorted(ran - set(per_request)))


def the_walk(walks: Iterable[ProcessWalk]) -> list[str]:
    """The files on the request's way in any process, each once, sorted."""
    return sorted({entry.file for walk in walks for entry in walk.on_the_way})


def render(walks: list[ProcessWalk]) -> str:
    def files(entries: list[FileCalls]) -> list[str]:
        return [f"    {e.file:<48} {e.calls_per_request:8.1f}" for e in entries] or ["    (none)"]

    lines = []
    for walk in walks:
        lines.append(f"{role(walk.process)} ({walk.process}): calls per request, by file")
        lines.append(f"  on the request's way, in and back: {len(walk.on_the_way)} files")
        lines += files(walk.on_the_way)
        for kind, entries in walk.beside.items():
            lines.append(f"  beside it, {kind}: {len(entries)} files")
            lines += files(entries)
        lines.append(f"  background (ran, not per request): {', '.join(walk.background) or '-'}")
        lines.append("")
    walk = the_walk(walks)
    lines.append(f"the walk, front end and engine together: {len(walk)} files")
    lines += [f"    {file}" for file in walk]
    return "\n".join(lines)


def service_pids(supervisor: int) -> dict[int, str]:
    """The service's own processes under ``supervisor``: pid -> name (``vitserve-...``)."""
    found = {}
    for pid in descendants(supervisor):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("vitserve-"):
            found[pid] = name
    return found


def take(
    directory: Path, tag: str, pids: Iterable[int], timeout_s: float = 60.0
) -> dict[int, dict]:
    """Each process's counts since its last take (the hook's report), read and reset by a signal."""
    pids = list(pids)
    (directory / request_walk_hook.COMMAND_FILE).write_text(tag)
    for pid in pids:
        os.kill(pid, request_walk_hook.SIGNAL)
    deadline = time.monotonic() + timeout_s
    reports: dict[int, dict] = {}
    while len(reports) < len(pids):
        for pid in pids:
            path = directory / f"{tag}-{pid}.json"
            if pid not in reports and path.exists():
                reports[pid] = json.loads(path.read_text())
        if time.monotonic() > deadline:
            missing = sorted(set(pids) - set(reports))
            raise RuntimeError(f"no {tag!r} counts from process(es) {missing}")
        time.sleep(0.01)
    return reports


def hooked_env(hook_dir: Path, checkout: Path, settings: Mapping[str, str]) -> dict[str, str]:
    """The hook's variables on top of the service's environment (``settings``)."""
    path = [str(hook_dir), settings.get("PYTHONPATH", "")]
    return {
        **settings,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        request_walk_hook.ROOT_VARIABLE: f"{checkout / 'service'}{os.sep}",
        request_walk_hook.DIRECTORY_VARIABLE: str(hook_dir),
    }


def send(connection: http.client.HTTPConnection, payload: Payload, count: int) -> None:
    headers = {"Content-Type": payload.content_type}
    for _ in range(count):
        connection.request("POST", payload.path, payload.body, headers)
        answer = connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{payload.path} answered {answer.status}: {data[:300]!r}")


def measure(
    checkout: Path, requests: int, workers: int, payload: Payload | None = None
) -> list[ProcessWalk]:
    """Each of the service's processes' walk, front ends first; each request ``payload`` (default:
    one base64 PNG in /predict's JSON)."""
    payload = payload if payload is not None else Payload.json_png()
    with tempfile.TemporaryDirectory() as scratch:
        hook_dir = Path(scratch)
        shutil.copy(Path(request_walk_hook.__file__), hook_dir / "sitecustomize.py")
        env = lambda port: hooked_env(hook_dir, checkout, service_env(port, workers=workers))  # noqa: E731
        argv = SERVICE if checkout == REPO else (sys.executable, "-m", "service")
        with running(argv, env, hook_dir / "service.log", ports=PORTS, cwd=checkout) as server:
            pids = service_pids(server.process.pid)
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            send(connection, payload, WARM_UP)
            take(hook_dir, "warm-up", pids)
            started = time.monotonic()
            send(connection, payload, requests)
            busy = take(hook_dir, "requests", pids)
            time.sleep(time.monotonic() - started)
            idle = take(hook_dir, "idle", pids)
            connection.close()
    walks = [
        walk_of(
            name,
            counts_of(busy[pid], checkout),
            counts_of(idle[pid], checkout),
            requests,
        )
        for pid, name in pids.items()
    ]
    return sorted(walks, key=lambda w: (role(w.process) != "front end", w.process))


def too_long(walks: list[ProcessWalk], max_files: int | None) -> str | None:
    """Why the walk breaks the bound ``max_files`` (None: no bound, or within it)."""
    count = len(the_walk(walks))
    if max_files is None or count <= max_files:
        return None
    return f"the walk holds {count} files, more than --max-files {max_files}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_walk", description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, default=1, help="front ends (VITSERVE_WORKERS)")
    parser.add_argument(
        "--checkout", type=Path, default=REPO, help="the vitserve tree to serve (default: this one)"
    )
    parser.add_argument(
        "--multipart",
        choices=sorted(FILE_KINDS),
        help="one file of this kind per request, multipart, to /models/{--model}/predict",
    )
    parser.add_argument("--model", default=MODEL, help="the model --multipart's requests name")
    parser.add_argument(
        "--max-files", type=int, help="exit 1 when the walk holds more files than this"
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers: at least one front end (the walk crosses the process hop)")
    checkout = args.checkout.resolve()
    payload = Payload.multipart(args.multipart, args.model) if args.multipart else None
    payload = payload or Payload.json_png()
    walks = measure(checkout, args.requests, args.workers, payload)
    print(f"{checkout}: {args.requests} {payload.described}, one at a time\n")
    print(render(walks))
    problem = too_long(walks, args.max_files)
    if problem is not None:
        print(f"\n{problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
