"""Model versions: which version answers under each version_policy, the settle window of poll mode,
a replaced version released (its batcher threads and sessions gone) once its last request is answered.

Scans are driven by hand (``ModelManager.poll_once``, with the background poll an hour away), so each
test says exactly how many scans saw a version, and the load attempts are counted, not inferred from
what answered.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.contract.model_config import read_model_config, write_model_config
from service.launcher.local_app import local_app
from tests.support import MODEL_NAME, assert_error, make_settings, wait_until


@pytest.fixture
def repository(model_repository: Path, tmp_path: Path) -> Path:
    """A copy of the test repository holding versions 1, 2 and 3 (the same graph each)."""
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    for version in (2, 3):
        shutil.copytree(copy / MODEL_NAME / "1", copy / MODEL_NAME / str(version))
    return copy


def set_policy(repository: Path, kind: str, versions: tuple[int, ...] = ()) -> None:
    path = repository / MODEL_NAME / "config.pbtxt"
    config = read_model_config(path)
    config.ClearField("version_policy")
    if kind == "latest":
        config.version_policy.latest.num_versions = versions[0]
    elif kind == "all":
        config.version_policy.all.SetInParent()
    else:
        config.version_policy.specific.versions.extend(versions)
    write_model_config(config, path)


def image() -> dict:
    return {"images": [{"pixels": [[0, 255], [255, 0]]}]}


def answering_version(client: TestClient, path: str = "/predict") -> int:
    response = client.post(path, json=image())
    assert response.status_code == 200, response.text
    return response.json()["model"]["version"]


@pytest.mark.parametrize(
    ("kind", "versions", "served", "default"),
    [
        ("latest", (1,), {3}, 3),
        ("latest", (2,), {2, 3}, 3),
        ("all", (), {1, 2, 3}, 3),
        ("specific", (1, 3), {1, 3}, 3),
        ("specific", (2,), {2}, 2),
    ],
    ids=["latest-1", "latest-2", "all", "specific-1-3", "specific-2"],
)
def test_the_version_policy_decides_which_versions_answer(
    repository, kind, versions, served, default
):
    set_policy(repository, kind, versions)
    with TestClient(local_app(make_settings(repository))) as client:
        assert answering_version(client) == default  # the highest version served
        for version in (1, 2, 3):
            path = f"/models/{MODEL_NAME}/versions/{version}/predict"
            if version in served:
                assert answering_version(client, path) == version
            else:
                assert_error(client.post(path, json=image()), 404, f"unknown version '{version}'")
        ready = {
            int(row["version"])
            for row in client.post("/v2/repository/index").json()
            if row["state"] == "READY"
        }
        assert ready == served


def test_a_pinned_version_overrides_the_policy(repository):
    set_policy(repository, "all")
    with TestClient(local_app(make_settings(repository, model_version=1))) as client:
        assert answering_version(client) == 1
        assert_error(
            client.post(f"/models/{MODEL_NAME}/versions/3/predict", json=image()), 404, "'3'"
        )


# --- the settle window of poll mode ----------------------------------------------------------------


@pytest.fixture
def hand_polled(model_repository: Path, tmp_path: Path) -> Iterator[TestClient]:
    """Poll mode whose own scan is an hour away: the test runs each scan (``scan(client)``)."""
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    settings = make_settings(copy, model_control="poll", repository_poll_s=3600.0)
    with TestClient(local_app(settings)) as client:
        yield client


def scan(client: TestClient) -> None:
    client.portal.call(client.app.state.engine.manager.poll_once)


def load_failures(client: TestClient) -> float:
    value = client.app.state.metrics.registry.get_sample_value(
        "vitserve_model_load_failures_total", {"model": MODEL_NAME}
    )
    return value or 0.0


def state_of(client: TestClient, version: int) -> str | None:
    rows = client.post("/v2/repository/index").json()
    return next((r["state"] for r in rows if r.get("version") == str(version)), None)


def test_a_new_version_is_tried_only_once_two_scans_saw_the_same_files(hand_polled):
    """A version directory written in place (a corrupt graph, so that a load attempt leaves a
    mark): the scan that first sees it does not try it; the next scan, seeing the same files, does
    (and fails, counted)."""
    version = Path(hand_polled.app.state.settings.repository.model_repository) / MODEL_NAME / "4"
    version.mkdir()
    (version / "model.onnx").write_bytes(b"half of a graph")
    before = load_failures(hand_polled)
    scan(hand_polled)
    assert load_failures(hand_polled) == before, "loaded on the first sighting"
    assert state_of(hand_polled, 4) is None
    scan(hand_polled)
    assert load_failures(hand_polled) == before + 1, "not tried once settled"
    assert state_of(hand_polled, 4) == "UNAVAILABLE"


def test_files_that_change_between_scans_are_not_tried_until_they_stop(hand_polled):
    repository = Path(hand_polled.app.state.settings.repository.model_repository)
    source = (repository / MODEL_NAME / "1" / "model.onnx").read_bytes()
    version = repository / MODEL_NAME / "2"
    version.mkdir()
    before = load_failures(hand_polled)
    third = len(source) // 3 + 1
    with (version / "model.onnx").open("wb") as graph:
        for start in range(0, len(source), third):
            graph.write(source[start : start + third])
            graph.flush()
            scan(hand_polled)  # every scan sees other files than the one before
            assert state_of(hand_polled, 2) is None
    for name in ("attention.onnx", "labels.txt"):
        shutil.copy(repository / MODEL_NAME / "1" / name, version / name)
    scan(hand_polled)  # the last change: seen once
    assert state_of(hand_polled, 2) is None
    scan(hand_polled)  # unchanged since: loaded
    assert state_of(hand_polled, 2) == "READY" and load_failures(hand_polled) == before
    assert answering_version(hand_polled) == 2


def test_a_version_the_policy_left_goes_when_another_wanted_one_is_ready(
    model_repository, tmp_path
):
    """``latest 2`` over versions 1 and 2, then a version 3 that fails to load: the policy now wants
    2 and 3, and 2 is ready, so version 1 stops answering (only when no wanted version is ready does
    what was served stay)."""
    repository = tmp_path / "models"
    shutil.copytree(model_repository, repository)
    shutil.copytree(repository / MODEL_NAME / "1", repository / MODEL_NAME / "2")
    set_policy(repository, "latest", (2,))
    settings = make_settings(repository, model_control="poll", repository_poll_s=3600.0)
    with TestClient(local_app(settings)) as client:
        assert (state_of(client, 1), state_of(client, 2)) == ("READY", "READY")
        broken = repository / MODEL_NAME / "3"
        broken.mkdir()
        (broken / "model.onnx").write_bytes(b"not a graph")
        scan(client)
        scan(client)  # settled: tried, and failed
        assert state_of(client, 3) == "UNAVAILABLE"
        assert state_of(client, 2) == "READY" and answering_version(client) == 2
        assert state_of(client, 1) is None
        refused = client.post(f"/models/{MODEL_NAME}/versions/1/predict", json=image())
        assert refused.status_code in (404, 503), refused.text


# --- releasing a replaced version ------------------------------------------------------------------


def batcher_threads() -> set[threading.Thread]:
    """The batchers' worker threads (one per graph and instance, named vitserve-<graph>-<i>)."""
    return {t for t in threading.enumerate() if t.name.startswith("vitserve-")}


def test_a_reloaded_version_releases_the_old_one_threads_and_sessions(repository):
    """Explicit mode, load the model again: the new pipeline serves; the old one's batchers are
    stopped (their worker threads end even while something still refers to them: garbage
    collection alone does not count), then its pipeline, runtime and onnxruntime sessions are
    freed."""
    settings = make_settings(repository, model_control="explicit", models=MODEL_NAME)
    others = batcher_threads()  # other apps' of this test session
    with TestClient(local_app(settings)) as client:
        manager = client.app.state.engine.manager

        def exercise() -> None:  # a batcher's thread starts with its first batch
            assert client.post("/predict", json=image()).status_code == 200
            attention = client.post("/attention", json={"image": image()["images"][0]})
            assert attention.status_code == 200

        exercise()
        threads = batcher_threads() - others
        assert len(threads) == 2, threads  # the classifier's and the attention graph's
        old = manager.resolve()
        old_batchers = old.batchers  # held: only a stop ends their threads now
        refs = [weakref.ref(old), weakref.ref(old.runtime)]
        refs += [weakref.ref(session) for session in old.runtime.classifiers]
        del old
        assert client.post(f"/v2/repository/models/{MODEL_NAME}/load").status_code == 200
        assert manager.resolve() is not refs[0]()
        exercise()
        assert len(batcher_threads() - others - threads) == 2  # the new version's
        ended = lambda: not any(thread.is_alive() for thread in threads)  # noqa: E731
        wait_until(ended, "the old batchers' threads to end", timeout_s=20)
        del old_batchers

        def freed() -> bool:
            gc.collect()
            return all(ref() is None for ref in refs)

        wait_until(freed, "the old pipeline, runtime and sessions to be freed", timeout_s=20)


def test_a_replaced_version_waits_for_its_last_leased_request(repository):
    """Two requests hold the old version; the first one ending does not release it, the second
    one does."""
    settings = make_settings(repository, model_control="explicit", models=MODEL_NAME)
    with TestClient(local_app(settings)) as client:
        pipeline = client.app.state.engine.manager.resolve()

        async def scenario() -> tuple[bool, bool]:
            pipeline.hold()  # two calls in flight
            pipeline.hold()
            retiring = asyncio.ensure_future(pipeline.retire(timeout_s=30))
            await asyncio.sleep(0.05)
            before_any = retiring.done()
            pipeline.release()  # the first answered
            # a retire woken now would stop an idle batcher in milliseconds: 0.3 s is ample
            done, _ = await asyncio.wait({retiring}, timeout=0.3)
            after_first = bool(done)
            pipeline.release()
            await asyncio.wait_for(retiring, 10)
            return before_any, after_first

        before_any, after_first = client.portal.call(scenario)
        assert not before_any
        assert not after_first, "released while a request still held it"
