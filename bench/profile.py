"""Where the service's core time goes per request, under load: ``python -m bench.profile``.

The service runs with its defaults; ``hey`` sends single-image requests at c=64; py-spy records it
(``--threads --nonblocking``, raw collapsed stacks) while the CPU time of each of its threads is read
from /proc. Each thread's CPU time is split over its samples' buckets; a sample belongs to the bucket
of its innermost frame that a rule below names (by module path and function), and a sample whose
innermost frame is a blocking wait is left out (py-spy counts a thread just woken as active). Threads
without Python frames (onnxruntime's intra-op pool) count as the model run. Divided by the requests
answered in the window: core milliseconds per request, by bucket. A flame graph SVG of a second window
goes to bench/results/.

    python -m bench.profile [--seconds 20] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench import hey
from bench.machine import CLOCK_TICKS, thread_ticks
from bench.payloads import b64_pngs, predict_body
from bench.server_process import REPO, running_service
from bench.stats import fmt, table

PORTS = range(18140, 18150)
HTTP = "HTTP and JSON parsing"
BASE64 = "base64"
DECODE = "image decode"
PREPROCESS = "preprocessing"
QUEUE = "queueing, batcher, thread hand-offs"
MODEL = "model run"
RESPONSE = "building the response"
LOGS = "logging, metrics, request ids"
OTHER = "other"
BUCKETS = (HTTP, BASE64, DECODE, PREPROCESS, QUEUE, MODEL, RESPONSE, LOGS, OTHER)

# (module path prefix, function name or "" for any, bucket), tried in order on each frame from the
# innermost one out; a frame no rule names (numpy, typing, contextlib, ...) leaves it to its caller.
RULES = (
    ("service/contract/decoding.py", "", DECODE),
    ("service/contract/preprocessing.py", "image_to_array", DECODE),
    ("service/contract/preprocessing.py", "shrink", DECODE),
    ("service/contract/preprocessing.py", "reducible", DECODE),
    ("service/contract/preprocessing.py", "", PREPROCESS),
    ("service/", "prepare_batch", PREPROCESS),
    ("PIL/", "", DECODE),
    ("base64.py", "", BASE64),
    ("onnxruntime/", "", MODEL),
    ("service/engine/runtime.py", "", MODEL),
    ("service/frontend/routers/predict.py", "predictions", RESPONSE),
    ("service/frontend/routers/predict.py", "prediction", RESPONSE),
    ("fastapi/routing.py", "serialize_response", RESPONSE),
    ("fastapi/encoders.py", "", RESPONSE),
    ("json/encoder.py", "", RESPONSE),
    ("pydantic/type_adapter.py", "dump_json", RESPONSE),
    ("pydantic/main.py", "__init__", RESPONSE),
    ("pydantic/main.py", "model_dump_json", RESPONSE),
    ("starlette/responses.py", "", RESPONSE),
    ("logging/", "", LOGS),
    ("prometheus_client/", "", LOGS),
    ("uuid.py", "", LOGS),
    ("service/observability/metrics.py", "", LOGS),
    ("service/engine/batcher.py", "", QUEUE),
    ("service/engine/pipeline.py", "", QUEUE),
    ("service/engine/model_manager.py", "", QUEUE),
    ("service/engine/state.py", "", QUEUE),
    ("asyncio/queues.py", "", QUEUE),
    ("asyncio/locks.py", "", QUEUE),
    ("asyncio/futures.py", "", QUEUE),
    ("concurrent/futures/", "", QUEUE),
    ("threading.py", "", QUEUE),
    ("anyio/", "", QUEUE),
    ("starlette/concurrency.py", "", QUEUE),
    ("json/decoder.py", "", HTTP),
    ("pydantic/main.py", "model_validate_json", HTTP),
    ("uvicorn/", "", HTTP),
    ("h11/", "", HTTP),
    ("starlette/", "", HTTP),
    ("fastapi/", "", HTTP),
    ("service/frontend/middleware.py", "", HTTP),
    ("service/frontend/server.py", "", HTTP),
    ("service/frontend/inputs.py", "", HTTP),
    ("service/frontend/security.py", "", HTTP),
    ("service/errors.py", "", HTTP),
    ("service/frontend/routers/", "", HTTP),
    ("asyncio/runners.py", "", HTTP),  # uvloop's C event loop below it: sockets, callbacks
)
# Innermost frames where a thread blocks: py-spy may sample a thread there as it wakes.
WAITS = (
    ("threading.py", "wait"),
    ("threading.py", "_acquire_restore"),
    ("threading.py", "acquire"),
    ("threading.py", "join"),
    ("concurrent/futures/thread.py", "_worker"),  # in SimpleQueue.get, which has no Python frame
)


def frame_parts(frame: str) -> tuple[str, str]:
    """``"Session.run (onnxruntime/capi/x.py:395)"`` -> ``("run", "onnxruntime/capi/x.py")``."""
    name, _, where = frame.rpartition(" (")
    return name.rsplit(".", 1)[-1], where.rstrip(")").rpartition(":")[0]


def bucket_of(frames: list[str]) -> str | None:
    """The bucket of one stack (outermost frame first); None for a blocking wait."""
    function, module = frame_parts(frames[-1])
    if any(module == m and function == f for m, f in WAITS):
        return None
    for frame in reversed(frames):
        function, module = frame_parts(frame)
        for prefix, name, bucket in RULES:
            if module.startswith(prefix) and name in ("", function):
                return bucket
    return OTHER


@dataclass(frozen=True)
class Stack:
    thread: int
    frames: list[str]
    count: int
    name: str = ""  # the thread's


def parse_raw(text: str) -> list[Stack]:
    """py-spy's ``--format raw --threads`` output: ``thread (TID): NAME;frame;...;frame COUNT``."""
    stacks = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        first, *frames = stack.split(";")
        if not first.startswith("thread ("):
            raise ValueError(f"not py-spy --threads raw output: {line[:200]}")
        if not frames:  # py-spy could not read this thread's stack
            continue
        tid, _, name = first[len("thread (") :].partition("): ")
        stacks.append(Stack(int(tid), frames, int(count), name))
    return stacks


def split(stacks: list[Stack], cpu_s: dict[int, float]) -> tuple[dict[str, float], float]:
    """CPU seconds per bucket: each thread's CPU shared over its samples' buckets (a thread sampled
    only while waiting: queueing); threads never sampled have no Python frames (onnxruntime's pool)
    and count as the model run. Also returns those threads' part."""
    samples: dict[int, Counter] = defaultdict(Counter)
    waiting = set()
    for stack in stacks:
        if (bucket := bucket_of(stack.frames)) is None:
            waiting.add(stack.thread)
        else:
            samples[stack.thread][bucket] += stack.count
    seconds = dict.fromkeys(BUCKETS, 0.0)
    unsampled = 0.0
    for thread, used in cpu_s.items():
        counts = samples.get(thread) or (Counter({QUEUE: 1}) if thread in waiting else None)
        if counts is None:
            seconds[MODEL] += used
            unsampled += used
            continue
        total = sum(counts.values())
        for bucket, count in counts.items():
            seconds[bucket] += used * count / total
    return seconds, unsampled


def other_frames(stacks: list[Stack], top: int = 5) -> list[tuple[str, float]]:
    """The innermost frames of the samples no rule named, with their share of all kept samples."""
    kept = [s for s in stacks if bucket_of(s.frames) is not None]
    total = sum(s.count for s in kept) or 1
    found: Counter = Counter()
    for stack in kept:
        if bucket_of(stack.frames) == OTHER:
            found[stack.frames[-1]] += stack.count
    return [(frame, count / total) for frame, count in found.most_common(top)]


@dataclass(frozen=True)
class Profile:
    seconds: float
    concurrency: int
    requests: float  # 200 answers in the window
    ms_per_request: dict[str, float]  # core milliseconds, by bucket
    unsampled_ms: float  # of the model run: threads without Python frames
    other: list[tuple[str, float]]
    flame_graph: str
    commands: list[str]

    def markdown(self) -> str:
        total = sum(self.ms_per_request.values())
        rows = [
            [bucket, fmt(ms, 3), f"{100 * ms / total:.0f}%" if total else "-"]
            for bucket, ms in self.ms_per_request.items()
        ]
        return "\n".join(
            [
                "## Where the service's core time goes (py-spy)",
                "",
                "vitserve in one process (`VITSERVE_WORKERS=0`: the engine in the front end; "
                "py-spy follows one process, and the per-request work is the same code), "
                f"otherwise its defaults, c={self.concurrency} single-image requests, "
                f"{self.seconds:g} s sampled, {fmt(self.requests)} requests answered 200 in the "
                f"window: **{fmt(total, 3)} core ms per request**. Of the model run, "
                f"{fmt(self.unsampled_ms, 3)} ms ran on threads without Python frames "
                "(onnxruntime's own). Flame graph: "
                f"`{self.flame_graph}` (not committed).",
                "",
                table(
                    ["bucket", "core ms per request", "share"],
                    [*rows, ["total", fmt(total, 3), "100%"]],
                ),
                "",
                "Innermost frames no rule names (share of the samples):",
                "",
                *(f"- `{frame}`: {100 * share:.1f}%" for frame, share in self.other),
                "",
                "Commands:",
                "",
                *(f"- `{command}`" for command in self.commands),
            ]
        )


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise FileNotFoundError("py-spy is not installed (pip install -r requirements/dev.txt)")
    return found


def run(out: Path, model_dir: Path, seconds: float, concurrency: int = 64) -> Profile:
    out.mkdir(parents=True, exist_ok=True)
    body = out / "body-1.json"
    body.write_bytes(predict_body(b64_pngs(1)[0]))
    svg_seconds = min(seconds, 10.0)
    record = [py_spy(), "record", "--threads", "--nonblocking", "--rate", "100"]
    repository = model_dir.parents[1]
    with running_service(
        out / "profile-service.log", ports=PORTS, model_repository=repository, workers=0
    ) as server:
        url, pid = server.url + "/predict", str(server.process.pid)
        hey.run(hey.command(url, body, concurrency=8, requests=200), wall_limit_s=120)
        load = hey.command(url, body, concurrency=concurrency, duration_s=seconds + svg_seconds + 4)
        loading = hey.start(load)
        time.sleep(1.5)
        raw, svg = out / "profile.txt", out / "profile.svg"
        spy = [*record, "--pid", pid, "--duration", f"{seconds:g}", "--format", "raw"]
        before, began = thread_ticks(server.process.pid), time.monotonic()
        subprocess.run([*spy, "--output", str(raw)], check=True, capture_output=True)
        after, window = thread_ticks(server.process.pid), time.monotonic() - began
        flame = [*record, "--pid", pid, "--duration", f"{svg_seconds:g}", "--format", "flamegraph"]
        subprocess.run([*flame, "--output", str(svg)], check=True, capture_output=True)
        measured = hey.finish(loading, wall_limit_s=seconds + svg_seconds + 90)
    cpu = {t: (ticks - before.get(t, 0)) / CLOCK_TICKS for t, ticks in after.items()}
    stacks = parse_raw(raw.read_text())
    used, unsampled = split(stacks, cpu)
    requests = measured.ok_rps * window
    per_request = {bucket: 1000 * s / requests for bucket, s in used.items()}
    return Profile(
        seconds,
        concurrency,
        requests,
        per_request,
        1000 * unsampled / requests,
        other_frames(stacks),
        str(svg.relative_to(REPO) if svg.is_relative_to(REPO) else svg),
        [hey.shown(load), " ".join(["py-spy", *spy[1:]]).replace(pid, "PID")],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="the sampled window")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    out = REPO / "bench" / "results" / f"profile-{dt.datetime.now():%Y%m%d-%H%M%S}"
    result = run(out, REPO / "models" / "fashion-mnist-vit" / "1", args.seconds, args.concurrency)
    text = result.markdown()
    (out / "profile.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
