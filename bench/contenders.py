"""Who bench/compare.py measures, with which request, at which concurrency levels.

- vitserve: ``python -m service`` with its default ``VITSERVE_WORKERS`` (``vitserve``: one per core but
  the engine's) and another count beside it (``w1``, or ``wN``: one per core, where the default is 1),
  and each ``--variant`` (one setting changed);
- plain: bench/baselines/plain_onnx_server.py, FastAPI + onnxruntime, batch 1, one intra-op thread;
  ``plain-legacy``, where a legacy model directory is given: the same server on
  ``torch.onnx.export(dynamo=False)``'s graph of the same checkpoint (what a user exports by hand);
- torch: bench/baselines/torch_eager_server.py, the same server with PyTorch eager;
- nomodel: bench/baselines/no_model_server.py, the plain server with no model run at all (what
  everything but the model costs a FastAPI server here: the bound the in-process ceiling meets);
- mosec and triton, the anchors (docs/decisions.md#performance-targets; bench/baselines/mosec_server.py, triton_server.py), each in its
  own venv (bench/baselines/venvs.py), with ``model_workers`` model processes (mosec) or model
  instances (Triton): one unless asked, as the issue-23 comparison measured them.

Single PNGs go to every server, 32 PNGs per request to vitserve (the plain server's images/s for the
same images is its single-image rate), and the FP32 tensor to every server that serves /v2. Two kinds
of request: ``png``, base64 PNGs (vitserve's /predict JSON; to Triton the same base64 text as an Open
Inference Protocol BYTES tensor), and ``tensor``, the model's FP32 input ``[1, 1, 28, 28]`` as an Open
Inference Protocol JSON tensor on /v2/models/{name}/infer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.baselines import MAX_BATCH, MAX_WAIT_MS
from bench.baselines.triton_server import PNG_SUFFIX
from bench.baselines.venvs import LIBDIR_CODE, MOSEC, TRITON, Venv
from bench.server_process import REPO, SERVICE, clean_env, service_env
from bench.targets import ANCHOR_LEVELS, PNG, TARGET_LEVELS, TENSOR, TENSOR_LEVELS

LEVELS = (1, 16, 64, 256)
BATCH_IMAGES = 32  # images per request of vitserve's multi-image case
# body styles: how a server is sent images
PREDICT, OIP_TENSOR, OIP_PNG = "predict", "oip-tensor", "oip-png"


@dataclass(frozen=True)
class Route:
    path: str
    body: str  # PREDICT, OIP_TENSOR or OIP_PNG


@dataclass(frozen=True)
class Server:
    key: str
    label: str
    argv: tuple[str, ...]  # "{port}" is replaced by the port it gets
    settings: dict[str, str] | None = None  # VITSERVE_* settings: a vitserve server
    routes: Mapping[str, Route] = field(default_factory=lambda: {PNG: Route("/predict", PREDICT)})
    venv: Venv | None = None  # runs in this venv (argv[0] is its python)
    ready_path: str = "/health/ready"
    batch_histogram: str | None = None  # on its /metrics: the batch sizes its model ran

    def shown(self) -> str:
        python = str(self.venv.python.relative_to(REPO)) if self.venv else "python"
        if self.venv and self.venv.libpython:
            python = f'LD_LIBRARY_PATH="$({python} -c "{LIBDIR_CODE}")" {python}'
        argv = " ".join([python, *self.argv[1:]]).replace("{port}", "PORT")
        return f"{_settings(self.settings)} {argv}" if self.settings else argv

    def env(self, port: int, model_dir: Path) -> dict[str, str]:
        if self.settings is None:
            return clean_env(self.venv.env() if self.venv else {})
        return service_env(port, model_repository=model_dir.parents[1], **self.settings)


def _settings(settings: dict[str, str]) -> str:
    return " ".join(f"VITSERVE_{k.upper()}={v}" for k, v in settings.items()) or "defaults"


def cores() -> int:
    return len(os.sched_getaffinity(0))


def default_workers() -> int:
    """The front ends ``python -m service`` runs here when VITSERVE_WORKERS is unset: one per core
    but the engine's (service/settings/link.py)."""
    return max(1, cores() - 1)


def _shown(model_dir: Path) -> Path:
    return model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir


def servers(
    model_dir: Path,
    variants: dict[str, dict[str, str]],
    workers: int | None = None,
    model_workers: int = 1,
    legacy_dir: Path | None = None,
) -> list[Server]:
    """Every server of the module's docstring; ``workers`` (the service's default when not given)
    is vitserve's ``VITSERVE_WORKERS``, and a second vitserve row runs another count beside it:
    ``w1`` (one front end) when ``workers`` is more, else ``wN``, one per core (none on one core);
    ``model_workers`` the anchors' model processes or instances; ``legacy_dir`` the model directory
    of the legacy export that ``plain-legacy`` serves (no ``plain-legacy`` without it)."""
    workers = workers or default_workers()
    other = 1 if workers > 1 else cores() if cores() > 1 else None
    baseline = ("--port", "{port}", "--model-dir", str(_shown(model_dir)))
    name = model_dir.parent.name
    infer = Route(f"/v2/models/{name}/infer", OIP_TENSOR)
    ours = {PNG: Route("/predict", PREDICT), TENSOR: infer}
    batching = f"max batch {MAX_BATCH}, {MAX_WAIT_MS} ms wait"

    def vitserve(key: str, settings: dict[str, str], routes: Mapping | None = None) -> Server:
        return Server(
            key,
            f"vitserve, {_settings(settings)}",
            SERVICE,
            settings,
            routes or {PNG: ours[PNG]},
            batch_histogram="vitserve_batch_size",
        )

    def plain(key: str, label: str, module: str, argv: tuple[str, ...] = baseline) -> Server:
        return Server(key, label, (sys.executable, "-m", f"bench.baselines.{module}", *argv))

    legacy = []
    if legacy_dir is not None:
        label = (
            "the plain server on torch.onnx.export(dynamo=False), opset 17, of the same checkpoint"
        )
        argv = ("--port", "{port}", "--model-dir", str(_shown(legacy_dir)))
        legacy.append(plain("plain-legacy", label, "plain_onnx_server", argv))
    stages, instances = "one batched onnxruntime stage", "a Python callable"
    if model_workers != 1:
        stages = f"{model_workers} batched onnxruntime processes"
        instances = f"{model_workers} instances of a Python callable"

    return [
        vitserve("vitserve", {"workers": str(workers)}, ours),
        *([vitserve(f"w{other}", {"workers": str(other)}, ours)] if other else []),
        *(vitserve(k, v) for k, v in variants.items()),
        plain("plain", "plain FastAPI + onnxruntime, batch 1, 1 thread", "plain_onnx_server"),
        *legacy,
        plain("torch", "plain FastAPI + PyTorch eager, batch 1", "torch_eager_server"),
        plain("nomodel", "the plain server with no model (every logit 0)", "no_model_server"),
        Server(
            "mosec",
            f"mosec {MOSEC.pin('mosec')}: Rust HTTP, {workers} decode processes, {stages} "
            f"({batching})",
            (
                *(str(MOSEC.python), "-m", "bench.baselines.mosec_server", *baseline),
                *("--address", "127.0.0.1", "--decoders", str(workers)),
                *(("--infer-workers", str(model_workers)) if model_workers != 1 else ()),
            ),
            venv=MOSEC,
            ready_path="/",
            batch_histogram="mosec_service_batch_size",
        ),
        Server(
            "triton",
            f"Triton (nvidia-pytriton {TRITON.pin('nvidia-pytriton')}'s tritonserver): C++ HTTP "
            f"and dynamic batcher ({batching}), {instances} that decodes and runs onnxruntime",
            (
                *(str(TRITON.python), "-m", "bench.baselines.triton_server", *baseline),
                *(("--instances", str(model_workers)) if model_workers != 1 else ()),
            ),
            routes={PNG: Route(f"/v2/models/{name}{PNG_SUFFIX}/infer", OIP_PNG), TENSOR: infer},
            venv=TRITON,
            ready_path=f"/v2/models/{name}{PNG_SUFFIX}/ready",
        ),
    ]


@dataclass(frozen=True)
class Case:
    server: str
    kind: str  # PNG or TENSOR
    images: int  # per request
    levels: tuple[int, ...]


def cases(plan_servers: list[Server], levels: tuple[int, ...]) -> list[Case]:
    """Single PNGs to every server (PyTorch and no-model at the target levels only, the anchors at
    theirs), 32 PNGs to vitserve, FP32 tensors to every server that serves /v2; each case at the levels
    of ``levels`` it wants."""
    by_key = {"torch": TARGET_LEVELS, "nomodel": TARGET_LEVELS}
    by_key |= {"mosec": ANCHOR_LEVELS, "triton": ANCHOR_LEVELS}
    found = []
    for server in plan_servers:
        wanted = [(PNG, 1, by_key.get(server.key, LEVELS))]
        if server.key == "vitserve":
            wanted.append((PNG, BATCH_IMAGES, LEVELS))
        if TENSOR in server.routes:
            wanted.append((TENSOR, 1, TENSOR_LEVELS))
        for kind, images, wants in wanted:
            at = tuple(c for c in levels if c in wants)
            if at:
                found.append(Case(server.key, kind, images, at))
    return found
