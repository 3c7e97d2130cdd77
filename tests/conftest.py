"""Fixtures shared by the service-level suites (tests/service, tests/reliability, tests/interop).

The tiny model is built once per session with ``export.onnx.export_model`` (the same code that writes
the shipped model), so these tests never depend on the shipped model's file. The tests may import
torch; the service never does (tests/service/test_startup.py checks it). The helpers that test modules
import are in tests/support.py; each directory's conftest.py adds or narrows what is its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from service.launcher.local_app import local_app
from service.settings import Settings
from tests.support import MODEL_NAME, TINY, Reference, Server, make_settings

torch.set_num_threads(1)  # a training run may hold the other cores

# pyproject's per-test timeout (120 s) fails a hang fast; a test marked slow (training runs, real
# servers under load) gets this instead, unless it sets its own with @pytest.mark.timeout.
SLOW_TIMEOUT_S = 600


# Tests that time the service or hold it under load: `make test` runs them alone, after the other
# tests have run on two pytest-xdist workers, since beside a neighbour their timings would measure it.
SERIAL = (
    "tests/reliability/",
    "tests/bench/",
    "tests/service/test_batcher.py",
    "tests/service/test_batcher_contract.py",
    "tests/service/test_server.py",
)
# What those folders hold that times nothing and loads no server: in-process apps, parsers, plans;
# and, by node id, such a test of a module that is otherwise timed.
UNTIMED = (
    "tests/reliability/test_bad_input_corpus.py",
    # seven services started on damaged models, each must exit naming the file: none ever loads
    "tests/reliability/test_faults.py::test_startup_with_a_bad_model_exits_non_zero_naming_file_and_problem",
    "tests/reliability/test_docs.py",
    "tests/reliability/test_hostile_repository.py",
    "tests/reliability/test_image_errors.py",
    "tests/reliability/test_json_guard.py",
    "tests/reliability/test_lying_headers.py",
    "tests/reliability/test_probe_listener.py",
    "tests/reliability/test_run_directory.py",
    "tests/reliability/test_schemathesis.py",
    "tests/reliability/test_strict_json_out.py",
    "tests/reliability/test_version_strings.py",
    "tests/bench/test_baselines.py",
    "tests/bench/test_compare.py",
    "tests/bench/test_contenders.py",
    "tests/bench/test_cuda.py",
    "tests/bench/test_decode.py",
    "tests/bench/test_engine_loop.py",
    "tests/bench/test_graphs.py",
    "tests/bench/test_hey.py",
    "tests/bench/test_int8_trial.py",
    "tests/bench/test_lone_call.py",
    "tests/bench/test_profile.py",
    "tests/bench/test_real_size.py",
    "tests/bench/test_run.py",
    "tests/bench/test_shadow.py",
    "tests/bench/test_stats.py",
    "tests/bench/test_swap.py",
    "tests/bench/test_targets.py",
    "tests/bench/test_venvs.py",
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The serial pass (``-m serial``) imports only the test files that SERIAL can mark: a module
    elsewhere holds no serial test, and importing the other hundred (and rewriting their asserts)
    cost that pass about 10 s of its collection."""
    if config.option.markexpr != "serial":
        return None
    if collection_path.is_file() and not collection_path.name.startswith("test_"):
        return None
    try:
        relative = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    if relative == ".":
        return None
    candidate = f"{relative}/" if collection_path.is_dir() else relative
    if any(prefix.startswith(candidate) or candidate.startswith(prefix) for prefix in SERIAL):
        return None
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        if item.nodeid.startswith(SERIAL) and not item.nodeid.startswith(UNTIMED):
            item.add_marker(pytest.mark.serial)
    keep = mutation_tests(os.environ.get(MUTATION_MODULES_VARIABLE, ""))
    if keep is None:
        return
    selected = [item for item in items if item.nodeid.startswith(keep)]
    deselected = [item for item in items if not item.nodeid.startswith(keep)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


# `make mutation MUTATE=...` names the modules it mutates here (mutmut's patterns: `service.batch*`);
# the tests run against them are then those that pyproject's [tool.vitserve.mutation-tests] lists for
# those modules, not the whole of [tool.mutmut]'s selection: mutmut runs, for each mutant, every
# selected test that reached the mutated function, and a module's own unit tests kill its mutants in
# seconds where the server tests that also pass through it take minutes.
MUTATION_MODULES_VARIABLE = "MUTATION_MODULES"


def mutation_tests(patterns: str) -> tuple[str, ...] | None:
    """The test paths (node id prefixes) for the modules matching ``patterns``, or None (no
    narrowing) when no pattern is given or one matches no module of the table."""
    import fnmatch
    import tomllib

    names = patterns.split()
    if not names:
        return None
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    table = tomllib.loads(pyproject.read_text("utf-8"))["tool"]["vitserve"]["mutation-tests"]
    modules = {path.removesuffix(".py").replace("/", "."): tests for path, tests in table.items()}
    keep: set[str] = set()
    for name in names:
        matched = [
            tests
            for module, tests in modules.items()
            if fnmatch.fnmatch(module, name)
            or fnmatch.fnmatch(f"{module}.x", name)  # "service.link.arena.x*"
            or name.startswith(f"{module}.")  # a mutant's own name
        ]
        if not matched:
            return None
        for tests in matched:
            keep.update(tests)
    return tuple(sorted(keep))


@pytest.fixture(scope="session", autouse=True)
def _clean_environment() -> Iterator[None]:
    """No VITSERVE_* from the developer's shell leaks into the settings under test."""
    saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("VITSERVE_")}
    saved_port = os.environ.pop("PORT", None)
    yield
    os.environ.update(saved)
    if saved_port is not None:
        os.environ["PORT"] = saved_port


# `make mutation` runs the tests once per mutant: it names a directory here so that the tiny model
# is exported once per mutation run (before any mutant is active), not once per mutant. `make pytest`
# names a fresh one for its two passes, so that the two xdist workers and the serial pass share one
# export (about 8 s each) instead of making three; a lock keeps the workers from exporting at once.
MODEL_CACHE_VARIABLE = "TESTS_MODEL_CACHE"


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository holding ``tiny-vit`` version 1, written by the export stage."""
    cache = os.environ.get(MODEL_CACHE_VARIABLE)
    if not cache:
        return export_tiny_model(tmp_path_factory.mktemp("export"))
    repository = Path(cache) / "models"
    Path(cache).mkdir(parents=True, exist_ok=True)
    with (Path(cache) / ".export.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (repository / MODEL_NAME / "1" / "attention.onnx").is_file():
            export_tiny_model(Path(cache))
    return repository


def export_tiny_model(work: Path) -> Path:
    """Exports the tiny model into ``work``/models and returns that repository."""
    from export.checkpoint import save_checkpoint
    from export.data import FASHION_MNIST_LABELS
    from export.model import VisionTransformer
    from export.onnx import export_model

    torch.manual_seed(0)
    model = VisionTransformer(TINY).eval()
    with torch.no_grad():  # the head starts at zero: give it weights so that classes differ
        torch.nn.init.normal_(model.head.weight, std=1.0)
        torch.nn.init.normal_(model.position_embedding, std=0.5)
    checkpoint = work / "tiny.safetensors"
    save_checkpoint(model, checkpoint, "fashion-mnist", FASHION_MNIST_LABELS)
    repository = work / "models"
    export_model(checkpoint, MODEL_NAME, 1, repository, measure=False, overwrite=True)
    return repository


@pytest.fixture(scope="session")
def fashion_images() -> np.ndarray:
    """24 real Fashion-MNIST test images, uint8 [N, 28, 28]: light objects on a dark background."""
    from export.data import load_dataset

    _, test = load_dataset("fashion-mnist")
    return test.images[:24, 0].numpy().copy()


@pytest.fixture(scope="session")
def settings(model_repository: Path) -> Settings:
    return make_settings(model_repository)


@pytest.fixture(scope="session")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(local_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    """A client of the module's real service process, ``server`` (a fixture of each module or
    directory that runs one)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def reference(model_repository: Path) -> Reference:
    return Reference.load(model_repository)


class ServiceLog(logging.Handler):
    """The records of the service's logger, and their messages (it does not propagate to the root
    logger, so caplog does not see them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.messages.append(record.getMessage())


@pytest.fixture
def service_log() -> Iterator[ServiceLog]:
    """What the service logs during the test, from INFO up."""
    handler = ServiceLog()
    logger = logging.getLogger("vitserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
