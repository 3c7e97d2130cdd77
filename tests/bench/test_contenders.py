"""Who the comparison measures, with which request and at which levels. No server starts here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import compare, contenders
from bench.baselines.venvs import MOSEC, TRITON

MODEL_DIR = Path("/repo/models/fashion-mnist-vit/1")


def by_key(servers):
    return {s.key: s for s in servers}


def test_every_server_once_vitserve_with_one_worker_per_core_and_with_one():
    servers = contenders.servers(MODEL_DIR, {"intra1": {"intra_op_threads": "1"}}, workers=2)
    keys = [s.key for s in servers]
    assert keys == ["vitserve", "w1", "intra1", "plain", "torch", "nomodel", "mosec", "triton"]
    found = by_key(servers)
    assert found["vitserve"].env(18110, MODEL_DIR)["VITSERVE_WORKERS"] == "2"
    assert found["w1"].env(18111, MODEL_DIR)["VITSERVE_WORKERS"] == "1"
    env = found["intra1"].env(18112, MODEL_DIR)
    assert env["VITSERVE_INTRA_OP_THREADS"] == "1" and env["VITSERVE_PORT"] == "18112"
    assert env["VITSERVE_MODEL_REPOSITORY"] == "/repo/models"
    assert "VITSERVE_WORKERS" not in env  # a variant changes one setting
    assert "VITSERVE_PORT" not in found["plain"].env(18113, MODEL_DIR)  # a baseline takes --port
    assert "--model-dir" in found["plain"].argv and "{port}" in found["plain"].argv
    # one core: no second vitserve row the same as the first
    assert "w1" not in by_key(contenders.servers(MODEL_DIR, {}, workers=1))


@pytest.mark.parametrize(
    ("cores", "rows"), [(2, {"vitserve": "1", "w2": "2"}), (4, {"vitserve": "3", "w1": "1"})]
)
def test_vitserve_runs_as_the_service_defaults_and_beside_it_another_count(
    monkeypatch, cores, rows
):
    """The ``vitserve`` row is what ``python -m service`` runs unset (one front end per core but the
    engine's); the other count is one front end, or one per core where the default is one."""
    monkeypatch.setattr(contenders, "cores", lambda: cores)
    found = {
        s.key: s.env(18110, MODEL_DIR)["VITSERVE_WORKERS"]
        for s in contenders.servers(MODEL_DIR, {})
        if s.key == "vitserve" or s.key.startswith("w")
    }
    assert found == rows


def test_the_anchors_run_in_their_venvs_on_their_routes():
    found = by_key(contenders.servers(MODEL_DIR, {}, workers=4))
    mosec, triton = found["mosec"], found["triton"]
    assert mosec.argv[0] == str(MOSEC.python) and mosec.venv is MOSEC
    assert mosec.argv[mosec.argv.index("--decoders") + 1] == "4"
    assert mosec.shown().startswith(".venv-mosec/bin/python -m bench.baselines.mosec_server")
    assert mosec.ready_path == "/" and mosec.routes[contenders.PNG].path == "/predict"
    assert triton.argv[0] == str(TRITON.python)
    assert triton.shown().startswith(
        """LD_LIBRARY_PATH="$(.venv-triton/bin/python -c "import sysconfig; """
        """print(sysconfig.get_config_var('LIBDIR'))")" .venv-triton/bin/python -m"""
    )
    assert triton.routes[contenders.PNG].path == "/v2/models/fashion-mnist-vit-png/infer"
    assert triton.routes[contenders.PNG].body == contenders.OIP_PNG
    assert triton.ready_path == "/v2/models/fashion-mnist-vit-png/ready"
    infer = contenders.Route("/v2/models/fashion-mnist-vit/infer", contenders.OIP_TENSOR)
    assert triton.routes[contenders.TENSOR] == found["vitserve"].routes[contenders.TENSOR] == infer
    env = triton.env(18117, MODEL_DIR) if TRITON.python.exists() else None
    assert env is None or env["LD_LIBRARY_PATH"].split(":")[0].endswith("lib")


def test_cases_each_server_at_its_levels():
    servers = contenders.servers(MODEL_DIR, {"int8": {"model_name": "x"}}, workers=2)
    cases = contenders.cases(servers, contenders.LEVELS)
    levels = {(c.server, c.kind, c.images): c.levels for c in cases}
    png, tensor = contenders.PNG, contenders.TENSOR
    everywhere = (1, 16, 64, 256)
    for key in ("vitserve", "w1", "int8", "plain"):
        assert levels[key, png, 1] == everywhere
    assert levels["vitserve", png, 32] == everywhere
    assert levels["torch", png, 1] == levels["nomodel", png, 1] == (64, 256)
    assert levels["mosec", png, 1] == levels["triton", png, 1] == (1, 64, 256)
    for key in ("vitserve", "w1", "triton"):
        assert levels[key, tensor, 1] == (64,)
    assert len(levels) == len(cases) == 12  # no other case
    quick = contenders.cases(servers, compare.Plan.for_run(quick=True).levels)
    assert {c.levels for c in quick} == {(64,)} and len(quick) == 12
    assert [c.server for c in contenders.cases(servers, (1,))].count("torch") == 0


def test_the_anchors_get_model_workers_and_plain_legacy_its_own_file_only_when_asked():
    legacy = Path("/repo/out/models/small-legacy/vit-small/1")
    found = by_key(contenders.servers(MODEL_DIR, {}, workers=2, model_workers=2, legacy_dir=legacy))
    mosec, triton, plain_legacy = found["mosec"], found["triton"], found["plain-legacy"]
    assert mosec.argv[mosec.argv.index("--infer-workers") + 1] == "2"
    assert "2 batched onnxruntime processes" in mosec.label
    assert triton.argv[triton.argv.index("--instances") + 1] == "2"
    assert "2 instances" in triton.label
    assert plain_legacy.argv[plain_legacy.argv.index("--model-dir") + 1] == str(legacy)
    assert found["plain"].argv[found["plain"].argv.index("--model-dir") + 1] == str(MODEL_DIR)
    assert plain_legacy.argv[:3] == found["plain"].argv[:3]  # the same server, another file
    # unasked: the issue-23 comparison's anchors as they were (one model process or instance)
    default = by_key(contenders.servers(MODEL_DIR, {}, workers=2))
    assert "plain-legacy" not in default
    assert "--infer-workers" not in default["mosec"].argv
    assert "--instances" not in default["triton"].argv
    assert "one batched onnxruntime stage" in default["mosec"].label
