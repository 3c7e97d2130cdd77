"""service/engine/model_manager.py driven directly (no app): explicit load and unload, which pipeline
takes a call resolved before a swap, a failed reload keeping what was served, and what is logged and
counted.

Written against `make mutation`'s survivors in the module (docs/testing.md). Each scenario runs one
event loop; scans are called by hand (poll mode's own scan is an hour away).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.contract.model_config import read_model_config, write_model_config
from service.contract.model_repository import ModelLoadError
from service.engine.model_manager import ModelManager, Route
from service.errors import NotFound, ServiceUnavailable
from service.observability.metrics import Metrics
from tests.service.test_model_versions import set_policy
from tests.support import MODEL_NAME, held, make_settings, run_on

OTHER = "other-vit"


@pytest.fixture
def repository(model_repository: Path, tmp_path: Path) -> Path:
    """Versions 1 and 2 of the tiny model (the same graph), and a second model with version 1."""
    copy = tmp_path / "models"
    shutil.copytree(model_repository, copy)
    shutil.copytree(copy / MODEL_NAME / "1", copy / MODEL_NAME / "2")
    shutil.copytree(copy / MODEL_NAME, copy / OTHER)
    shutil.rmtree(copy / OTHER / "2")
    config = copy / OTHER / "config.pbtxt"
    config.write_text(config.read_text().replace(f'"{MODEL_NAME}"', f'"{OTHER}"'))
    return copy


@pytest.fixture
def records(service_log) -> list[str]:
    return service_log.messages


def manager_for(repository: Path, **settings: object) -> ModelManager:
    values = {"model_control": "poll", "repository_poll_s": 3600.0, "models": "*", **settings}
    return ModelManager(make_settings(repository, **values), Metrics())


def info(manager: ModelManager, name: str, version: str) -> float | None:
    pipeline = next(
        s.pipeline for m in manager.models.values() for s in m.versions.values() if s.pipeline
    )
    labels = {"model": name, "version": version, "provider": pipeline.runtime.provider}
    labels["precision"] = pipeline.metadata.precision
    return manager.metrics.registry.get_sample_value("vitserve_model_info", labels)


def test_explicit_load_and_unload_of_one_model_leave_the_other(repository, records):
    set_policy(repository, "all")

    async def scenario() -> None:
        manager = manager_for(repository, model_control="explicit", models=MODEL_NAME)
        await manager.start()
        with pytest.raises(NotFound) as error:
            await manager.load("nope")
        assert error.value.message == "model 'nope' is not in the model repository"
        assert error.value.field == "model"
        await manager.load(OTHER)
        assert manager.resolve(OTHER).name == OTHER
        assert manager.resolve(MODEL_NAME, 1).version == 1
        assert manager.resolve(MODEL_NAME).version == 2 and manager.model(OTHER).name == OTHER
        await manager.unload(OTHER)
        assert manager.models[OTHER].unloaded is True and not manager.models[OTHER].versions
        assert manager.resolve().name == MODEL_NAME  # the default model serves on
        with pytest.raises((NotFound, ServiceUnavailable)):
            manager.resolve(OTHER)
        assert "releasing other-vit version 1: unloaded on request" in records
        await manager.load(OTHER)
        assert manager.models[OTHER].unloaded is False and manager.resolve(OTHER).name == OTHER
        # a model folder gone after it was managed: not in the repository any more
        shutil.rmtree(repository / OTHER)
        with pytest.raises(NotFound, match="'other-vit' is not in the model repository"):
            await manager.load(OTHER)
        await manager.stop(5)

    asyncio.run(scenario())


def test_an_explicit_load_says_why_and_what_still_serves(repository):
    set_policy(repository, "all")

    async def scenario() -> None:
        manager = manager_for(repository, model_control="explicit", models=MODEL_NAME)
        await manager.start()
        (repository / MODEL_NAME / "2" / "model.onnx").write_bytes(b"not a graph")
        (repository / MODEL_NAME / "3").mkdir()  # no model.onnx: its files cannot be read
        with pytest.raises(ModelLoadError) as error:
            await manager.load(MODEL_NAME)
        message = str(error.value)
        first, second, kept = (
            message.split("; ")[0],
            message.split("; ")[1],
            message.split("; ")[-1],
        )
        assert first.startswith("tiny-vit/2/model.onnx: onnxruntime cannot load"), message
        assert second.startswith("tiny-vit/3/model.onnx is missing"), message
        assert kept == "still serving version(s) [1, 2]" and str(repository) not in message
        status = manager.models[MODEL_NAME].versions[3]
        assert (status.version, status.state) == (3, "UNAVAILABLE")
        assert status.reason.startswith("tiny-vit/3/model.onnx is missing")
        await manager.load(OTHER)
        shutil.rmtree(repository / OTHER / "1")  # managed, its folder there, no version left
        with pytest.raises(ModelLoadError) as error:
            await manager.load(OTHER)
        assert str(error.value) == "no version directory"
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_broken_config_keeps_what_was_served_is_said_once_and_its_fix_reloads(
    repository, records
):
    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        served = manager.resolve(MODEL_NAME)
        failures = manager.metrics.model_load_failures.labels(MODEL_NAME)
        config = repository / MODEL_NAME / "config.pbtxt"
        good = config.read_text()
        config.write_text("max_batch_size: many\n")
        for _ in range(3):
            await manager.poll_once()
        assert failures._value.get() == 1  # the same broken file: said once
        status = manager.models[MODEL_NAME].versions[2]
        assert status.pipeline is served
        assert status.reason.startswith(
            "serving the previous config; the new one is refused: tiny-vit/config.pbtxt: line 1"
        )
        assert manager.models[MODEL_NAME].config_problem.startswith("tiny-vit/config.pbtxt")
        assert any(
            m.startswith("cannot load tiny-vit version -: tiny-vit/config.pbtxt: line 1")
            for m in records
        ), records
        config.write_text(good)
        await manager.poll_once()
        assert manager.resolve(MODEL_NAME) is not served  # reloaded with the fixed config
        assert manager.models[MODEL_NAME].config_problem == ""
        # a new model whose config is broken from the start: known, with its problem, unserved
        shutil.copytree(repository / OTHER, repository / "bad-vit")
        (repository / "bad-vit" / "config.pbtxt").write_text("max_batch_size: many\n")
        await manager.poll_once()
        bad = manager.models["bad-vit"]
        assert bad.name == "bad-vit" and bad.serving is None and not bad.versions
        assert bad.config_problem.startswith("bad-vit/config.pbtxt: line 1")
        assert manager.metrics.model_load_failures.labels("bad-vit")._value.get() == 1
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_scan_reloads_each_changed_version_once_it_has_settled(repository):
    set_policy(repository, "all")

    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        v1, v2 = manager.resolve(MODEL_NAME, 1), manager.resolve(MODEL_NAME, 2)
        graph = repository / MODEL_NAME / "2" / "model.onnx"
        graph.write_bytes(graph.read_bytes())  # new files, the same graph
        await manager.poll_once()  # first sighting of the new v2
        assert manager.resolve(MODEL_NAME, 2) is v2
        other = repository / MODEL_NAME / "1" / "model.onnx"
        other.write_bytes(other.read_bytes())
        await manager.poll_once()  # v1 changed, not settled; v2 settled: reloaded
        assert manager.resolve(MODEL_NAME, 1) is v1
        assert manager.resolve(MODEL_NAME, 2) is not v2
        await manager.poll_once()
        assert manager.resolve(MODEL_NAME, 1) is not v1
        await manager.stop(5)

    asyncio.run(scenario())


def pipeline_for(manager: ModelManager, name: str, version: int, requested, key) -> object:
    """The pipeline ``ModelManager.target`` runs a classifier call of this route on."""
    return manager.target(Route(name, version, requested, key, "classifier"))[0]


def test_a_call_resolved_before_a_swap_goes_to_a_version_that_can_take_it(repository, records):
    async def scenario() -> None:
        set_policy(repository, "all")
        manager = manager_for(repository)
        await manager.start()
        v1, v2 = manager.resolve(MODEL_NAME, 1), manager.resolve(MODEL_NAME, 2)
        key = v2.view.preprocessing_key
        other_key = key ^ 1  # another version's rows
        assert pipeline_for(manager, MODEL_NAME, 1, 1, key) is v1
        assert pipeline_for(manager, MODEL_NAME, 2, None, other_key) is v2
        # kept for the next calls of these routes, until the versions change
        assert manager.routes[Route(MODEL_NAME, 1, 1, key, "classifier")] == (v1, v1.classifier)
        # but not a route no honest front end sends (another key): a hostile one cannot grow them
        assert Route(MODEL_NAME, 2, None, other_key, "classifier") not in manager.routes
        with held(v1):  # v1 still answering a request when the policy drops it
            set_policy(repository, "latest", (1,))
            await manager.poll_once()
            assert (
                "releasing tiny-vit version 1: removed from the repository or the version policy"
                in records
            )
            assert info(manager, MODEL_NAME, "1") is None and info(manager, MODEL_NAME, "2") == 1
            v2 = manager.resolve(MODEL_NAME)  # reloaded: its config changed
            assert v2.version == 2
            assert manager.routes == {}  # resolved anew after the swap
            # the newest version asked for: the version now routed to, when it takes the same rows
            assert pipeline_for(manager, MODEL_NAME, 1, None, key) is v2
            # otherwise the retired version, still draining, takes what was resolved to it
            assert pipeline_for(manager, MODEL_NAME, 1, None, other_key) is v1
            assert pipeline_for(manager, MODEL_NAME, 1, 1, key) is v1
            assert set(manager.routes) == {Route(MODEL_NAME, 1, None, key, "classifier")}
            assert pipeline_for(manager, MODEL_NAME, 2, 2, other_key) is v2
            with pytest.raises(NotFound):
                pipeline_for(manager, MODEL_NAME, 7, 7, key)
            with pytest.raises(NotFound):
                pipeline_for(manager, "unknown-vit", 1, None, key)
            assert pipeline_for(manager, OTHER, 1, None, key).name == OTHER
        await manager.stop(5)
        assert not v1.accepting

    asyncio.run(scenario())


def test_a_reload_that_fails_keeps_the_loaded_files_and_is_tried_once(repository, records):
    async def scenario() -> None:
        manager = manager_for(repository, retry_after_s=9)
        await manager.start()
        served = manager.resolve(MODEL_NAME, 2)
        failures = manager.metrics.model_load_failures.labels(MODEL_NAME)
        (repository / MODEL_NAME / "2" / "model.onnx").write_bytes(b"not a graph")
        for _ in range(4):  # the first sighting, the settled one, then nothing new
            await manager.poll_once()
        assert failures._value.get() == 1
        status = manager.models[MODEL_NAME].versions[2]
        assert status.pipeline is served and status.state == "READY"
        assert status.reason.startswith("kept the loaded files; the new ones failed: ")
        assert any(m.startswith("cannot load tiny-vit version 2: ") for m in records), records
        # a new version that never loads: UNAVAILABLE with its number, tried once
        shutil.copytree(repository / MODEL_NAME / "1", repository / MODEL_NAME / "3")
        (repository / MODEL_NAME / "3" / "model.onnx").write_bytes(b"not a graph either")
        for _ in range(4):
            await manager.poll_once()
        assert failures._value.get() == 2
        failed = manager.models[MODEL_NAME].versions[3]
        assert (failed.version, failed.state) == (3, "UNAVAILABLE") and failed.reason
        assert manager.resolve(MODEL_NAME).version == 2
        with pytest.raises(ServiceUnavailable) as refused:
            manager.resolve(MODEL_NAME, 3)
        assert refused.value.headers == {"Retry-After": "9"}  # the settings', not the default
        # a config that cannot be read: logged without a version
        (repository / MODEL_NAME / "config.pbtxt").write_text("max_batch_size: many\n")
        await manager.poll_once()
        assert any(
            m.startswith("cannot load tiny-vit version -: tiny-vit/config.pbtxt") for m in records
        )
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_removed_model_directory_is_released(repository, records):
    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        shutil.rmtree(repository / OTHER)
        await manager.poll_once()
        assert not manager.models[OTHER].versions
        assert "releasing other-vit version 1: model directory removed" in records
        assert manager.resolve().name == MODEL_NAME
        await manager.stop(5)

    asyncio.run(scenario())


def test_the_drains_deadline_fails_what_is_queued_with_its_message(repository):
    async def scenario() -> None:
        manager = manager_for(repository, max_queue_delay_ms=10_000.0, idle_dispatch=False)
        await manager.start()
        pipeline = manager.resolve()
        run = asyncio.ensure_future(
            run_on(pipeline, "classifier", np.zeros((3, 1, 28, 28), np.float32))
        )
        await asyncio.sleep(0.05)  # queued behind the 10 s delay
        assert manager.fail_unanswered() == 3
        with pytest.raises(ServiceUnavailable) as error:
            await run
        assert error.value.message == "the service shut down before this request was answered"
        await manager.stop(5)

    asyncio.run(scenario())


def test_start_refuses_names_it_cannot_serve_and_says_what_there_is(repository, tmp_path):
    async def refused(repo: Path, **settings: object) -> str:
        manager = manager_for(repo, **settings)
        with pytest.raises(ModelLoadError) as error:
            await manager.start()
        await manager.stop(5)
        return str(error.value)

    async def scenario() -> None:
        message = await refused(repository, models="nope,zzz")
        assert message == (
            f"VITSERVE_MODELS names 'nope', 'zzz', not in {repository}; "
            f"available: {OTHER}, {MODEL_NAME}"
        )
        message = await refused(repository, model_name="zzz")
        assert message == (
            f"model 'zzz' not found in {repository}; available: {OTHER}, {MODEL_NAME} "
            "(set VITSERVE_MODEL_NAME)"
        )
        empty = tmp_path / "empty"
        empty.mkdir()
        assert (await refused(empty)).endswith("available: none (set VITSERVE_MODEL_NAME)")
        assert (await refused(empty, models="x")).endswith("available: none")
        # a named model that is not the default must load too
        (repository / OTHER / "1" / "model.onnx").write_bytes(b"not a graph")
        message = await refused(repository, models=f"{MODEL_NAME},{OTHER}")
        assert message.startswith(f"model '{OTHER}' has no version that loads: version 1: ")
        assert "other-vit/1/model.onnx" in message
        (repository / MODEL_NAME / "2" / "model.onnx").write_bytes(b"not a graph")
        message = await refused(repository, models=MODEL_NAME)
        assert message.startswith(f"model '{MODEL_NAME}' has no version that loads: version 2: ")

    asyncio.run(scenario())


def test_before_start_nothing_resolves_and_without_a_repository_only_managed_names_are_known(
    repository,
):
    async def scenario() -> None:
        manager = manager_for(repository, model_control="explicit", models=MODEL_NAME)
        with pytest.raises(ServiceUnavailable) as error:
            manager.resolve()
        assert error.value.code == "not_ready" and not manager.ready
        assert manager.routing().repository_names == frozenset()
        await manager.start()
        with pytest.raises(NotFound, match=r"'other-vit' is not loaded \(model control 'explicit'"):
            manager.resolve(OTHER)
        repository.rename(repository.with_name("moved"))
        assert manager.known_names() == {MODEL_NAME}
        assert manager.routing().repository_names == frozenset()
        repository.with_name("moved").rename(repository)
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_released_version_is_stopped_after_graceful_shutdown_s_even_if_still_leased(repository):
    async def scenario() -> None:
        set_policy(repository, "all")
        manager = manager_for(repository, graceful_shutdown_s=0.2)
        await manager.start()
        v1 = manager.resolve(MODEL_NAME, 1)
        with held(v1):  # a request that never ends
            set_policy(repository, "latest", (1,))
            await manager.poll_once()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while v1.accepting and loop.time() < deadline:
                await asyncio.sleep(0.02)
            assert not v1.accepting
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_failed_scan_is_logged_and_polling_goes_on(repository, records):
    async def scenario() -> None:
        manager = manager_for(repository, repository_poll_s=0.05)
        await manager.start()
        moved = repository.with_name("moved")
        repository.rename(moved)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        expected = f"scanning the model repository {repository} failed"
        while expected not in records and loop.time() < deadline:
            await asyncio.sleep(0.02)
        moved.rename(repository)
        assert expected in records
        assert manager._poller is not None and not manager._poller.done()
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_pinned_version_pins_the_default_model_only_and_errors_name_the_model(repository):
    async def scenario() -> None:
        manager = manager_for(repository, model_version=1)
        await manager.start()
        assert manager.resolve().version == 1 and manager.resolve(OTHER).version == 1
        await manager.stop(5)
        pinned = manager_for(repository, model_version=2, max_queue_size=None)
        await pinned.start()
        assert pinned.resolve().version == 2
        assert pinned.resolve(OTHER).version == 1  # other-vit has no version 2: not pinned
        path = repository / OTHER / "config.pbtxt"
        config = read_model_config(path)
        config.dynamic_batching.default_queue_policy.max_queue_size = 2
        write_model_config(config, path)
        await pinned.poll_once()
        problem = pinned.models[OTHER].config_problem
        assert problem.startswith("other-vit: max_queue_size (2) must be at least"), problem
        await pinned.stop(5)

    asyncio.run(scenario())


def test_a_specific_version_that_is_missing_is_unavailable_with_what_there_is(repository):
    set_policy(repository, "specific", (1, 5, 7))

    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        for version in (5, 7):
            status = manager.models[MODEL_NAME].versions[version]
            assert (status.version, status.state) == (version, "UNAVAILABLE")
            assert status.reason == (
                f"version {version} of model 'tiny-vit' not found in tiny-vit/; available: 1, 2"
            )
        assert manager.resolve().version == 1
        await manager.stop(5)

    asyncio.run(scenario())


def test_a_load_is_timed_logged_and_a_version_loading_says_so(repository, records, monkeypatch):
    from service.engine import model_manager as module

    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        labels = {"model": MODEL_NAME, "version": "2"}
        registry = manager.metrics.registry
        for phase in ("load", "warmup"):
            seconds = registry.get_sample_value(
                "vitserve_model_load_seconds", {**labels, "phase": phase}
            )
            assert seconds is not None and seconds >= 0
        directory = repository / MODEL_NAME / "2"
        assert any(
            m.startswith(
                f"serving tiny-vit version 2 from {directory} on CPUExecutionProvider (loaded in "
            )
            and m.endswith("; max batch 8, 2 instance(s))")
            for m in records
        ), records
        status = manager.models[MODEL_NAME].versions[2]
        assert (status.version, status.state) == (2, "READY")
        # a new version, seen twice: LOADING while its runtime loads, then out of memory
        seen: list[tuple] = []

        def load(files, settings, serving, batching):
            state = manager.models[MODEL_NAME].versions[files.version]
            seen.append((state.version, state.state))
            raise MemoryError

        monkeypatch.setattr(module.Runtime, "load", load)
        shutil.copytree(repository / MODEL_NAME / "1", repository / MODEL_NAME / "3")
        await manager.poll_once()
        await manager.poll_once()
        assert seen == [(3, "LOADING")]
        failed = manager.models[MODEL_NAME].versions[3]
        assert (failed.state, failed.reason) == ("UNAVAILABLE", "out of memory (MemoryError)")
        assert manager._poller is not None and manager._poller.get_name() == "poll"
        await manager.stop(5)

    asyncio.run(scenario())


def test_the_models_of_the_first_load_load_at_once(repository, monkeypatch):
    """As Triton's model-load threads: each model of the start loads in a thread of its own, so
    both reach the barrier; one after the other, the first would wait there alone and fail."""
    import threading

    from service.engine import model_manager as module

    barrier = threading.Barrier(2, timeout=10)
    load = module.Runtime.load

    def load_beside_the_other(files, settings, serving, batching):
        barrier.wait()
        return load(files, settings, serving, batching)

    monkeypatch.setattr(module.Runtime, "load", load_beside_the_other)

    async def scenario() -> None:
        manager = manager_for(repository, models=f"{MODEL_NAME},{OTHER}")
        await manager.start()
        for name in (MODEL_NAME, OTHER):
            states = {v: s.state for v, s in manager.models[name].versions.items()}
            assert set(states.values()) == {"READY"}, (name, states)
        await manager.stop(5)

    asyncio.run(scenario())


def test_start_names_every_version_that_failed_or_none(repository):
    async def scenario() -> None:
        set_policy(repository, "all")
        for version in (1, 2):
            (repository / MODEL_NAME / str(version) / "model.onnx").write_bytes(b"not a graph")
        manager = manager_for(repository, models=MODEL_NAME)
        with pytest.raises(ModelLoadError) as error:
            await manager.start()
        message = str(error.value)
        assert message.startswith("model 'tiny-vit' has no version that loads: version 1: ")
        assert "; version 2: tiny-vit/2/model.onnx" in message
        await manager.stop(5)
        (repository / MODEL_NAME / "config.pbtxt").write_text("max_batch_size: many\n")
        manager = manager_for(repository, models=MODEL_NAME)
        with pytest.raises(ModelLoadError) as error:
            await manager.start()
        assert str(error.value) == "model 'tiny-vit' has no version that loads: none"
        await manager.stop(5)

    asyncio.run(scenario())


def test_files_that_go_missing_keep_the_loaded_version_and_are_tried_once(repository, records):
    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        served = manager.resolve(MODEL_NAME, 2)
        (repository / MODEL_NAME / "2" / "model.onnx").unlink()
        for _ in range(4):
            await manager.poll_once()
        assert manager.metrics.model_load_failures.labels(MODEL_NAME)._value.get() == 1
        status = manager.models[MODEL_NAME].versions[2]
        assert status.pipeline is served and manager.resolve() is served
        assert status.reason.startswith(
            "kept the loaded files; the new ones failed: tiny-vit/2/model.onnx is missing"
        )
        assert any(
            m.startswith("cannot load tiny-vit version 2: tiny-vit/2/model.onnx is missing")
            for m in records
        )
        p = manager.resolve()
        await manager.stop(5)
        assert not p.accepting  # stop retires what is served

    asyncio.run(scenario())


def test_a_version_removed_and_put_back_settles_again_and_a_dropped_one_is_released(repository):
    set_policy(repository, "all")

    async def scenario() -> None:
        manager = manager_for(repository)
        await manager.start()
        kept = repository / "kept-2"
        shutil.copytree(
            repository / MODEL_NAME / "2", kept
        )  # copy2: the same times, same signature
        shutil.rmtree(repository / MODEL_NAME / "2")
        await manager.poll_once()
        assert 2 not in manager.models[MODEL_NAME].versions
        kept.rename(repository / MODEL_NAME / "2")
        await manager.poll_once()  # a first sighting again, however it looked before
        with pytest.raises(NotFound):
            manager.resolve(MODEL_NAME, 2)
        await manager.poll_once()
        v1, v2 = manager.resolve(MODEL_NAME, 1), manager.resolve(MODEL_NAME, 2)
        # v1 unchanged, v2's files new: v2 alone is reloaded once settled
        graph = repository / MODEL_NAME / "2" / "model.onnx"
        graph.write_bytes(graph.read_bytes())
        await manager.poll_once()
        await manager.poll_once()
        assert manager.resolve(MODEL_NAME, 1) is v1 and manager.resolve(MODEL_NAME, 2) is not v2
        # the policy keeps version 1 only: the version after it is released
        set_policy(repository, "specific", (1,))
        await manager.poll_once()
        assert sorted(manager.models[MODEL_NAME].versions) == [1]
        await manager.stop(5)

    asyncio.run(scenario())
