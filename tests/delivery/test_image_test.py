"""The image test's own logic, where it can be checked without an engine (`make image-test` runs
the rest): image names as Docker reads them, when sandbox settings are allowed and what they set,
the ports it takes, and the Fashion-MNIST images it judges /predict with."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

import numpy as np
import pytest

from deploy.image_test import base, engine, project
from deploy.image_test.checks import fashion_mnist_test_set

pytestmark = pytest.mark.delivery


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("python:3.11-slim-bookworm", "docker.io/library/python:3.11-slim-bookworm"),
        ("nvidia/cuda:13.0.1-runtime", "docker.io/nvidia/cuda:13.0.1-runtime"),
        ("localhost/vitserve-stand-in/python:3.11", "localhost/vitserve-stand-in/python:3.11"),
        ("mirror.example/python:3.11", "mirror.example/python:3.11"),
        ("mirror:5000/python:3.11", "mirror:5000/python:3.11"),
    ],
)
def test_short_names_are_read_as_docker_reads_them(image, expected):
    """Docker's rule (distribution/reference): a first part without '.' or ':' that is not
    localhost is a Docker Hub namespace; no '/' at all is docker.io/library."""
    assert base.qualified(image) == expected


def test_the_official_base_is_the_dockerfiles():
    assert base.dockerfile_default("PYTHON_IMAGE") == "python:3.11-slim-bookworm"


@pytest.mark.parametrize(
    ("variables", "allowed"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "1"}, False),
        ({engine.SANDBOX_OPT_IN: "1"}, True),
        ({engine.SANDBOX_OPT_IN: "yes"}, False),
    ],
)
def test_sandbox_settings_only_where_allowed(monkeypatch, variables, allowed):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(engine.SANDBOX_OPT_IN, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert engine.sandbox_allowed() is allowed


def test_sandbox_settings_stay_within_this_process_limits(tmp_path, capsys):
    """A container may not be given more than the sandbox lets this process have (runc fails to
    set a limit above it), and the settings go to this run's own containers.conf."""
    env, options = engine.sandbox_settings(tmp_path)
    conf = (tmp_path / "containers.conf").read_text()
    assert env == {"CONTAINERS_CONF": str(tmp_path / "containers.conf")}
    for name, limit in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(limit)[1]
        (soft_set, hard_set) = conf.split(f'"{name}=', 1)[1].split('"', 1)[0].split(":")
        assert soft_set == hard_set
        assert hard == resource.RLIM_INFINITY or int(hard_set) <= hard
    if options:
        assert options[0] == "--volume" and options[1].endswith(
            ":/etc/ssl/certs/ca-certificates.crt:ro"
        )
    assert "sandbox settings, for this run's podman only" in capsys.readouterr().out


def test_ports_are_free_and_outside_the_test_suites():
    ports = project.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        assert 18500 <= port < 18600
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_the_predict_images_are_fashion_mnist_test_images():
    """Against export.data's own reader of the same IDX files."""
    data = pytest.importorskip("export.data")
    spec = data.DATASETS["fashion-mnist"]
    split = data.load_idx_split(Path(spec.default_dir), "t10k", spec)
    images, labels = fashion_mnist_test_set(5)
    assert labels == split.labels[:5].tolist()
    assert np.array_equal(np.array(images, dtype=np.uint8), split.images[:5, 0].numpy())
