"""The swap benchmark's logic: when the answers switched versions, what failed, how a new version
is published. The run itself needs a service with live model updates (VITSERVE_MODEL_CONTROL=poll)."""

from __future__ import annotations

from bench.swap import Probe, Swap, Switch, Window, analyse, stage


def probes(*samples: tuple[float, int, int | None]) -> list[Probe]:
    return [Probe(t, status, version) for t, status, version in samples]


def test_a_clean_switch():
    switch = analyse(probes((-0.5, 200, 1), (0.2, 200, 1), (0.9, 200, 2), (1.5, 200, 2)), 1, 2)
    assert switch == Switch(first_new_s=0.9, last_old_s=0.2, back_to_old=0, failed=0)


def test_answers_that_go_back_to_the_old_version_and_failures_are_counted():
    samples = probes((1.0, 200, 2), (-1.0, 200, 1), (1.2, 200, 1), (1.4, 503, None), (1.6, 0, None))
    switch = analyse(samples, 1, 2)  # given out of order: sorted by time first
    assert switch == Switch(first_new_s=1.0, last_old_s=1.2, back_to_old=1, failed=2)


def test_never_switched():
    assert analyse(probes((0.0, 200, 1), (3.0, 200, 1)), 1, 2).first_new_s is None


def swap(switch: Switch, non_200: int = 0, errors: int = 0) -> Swap:
    windows = [
        Window("before", 8.0, 9000, 0, 0, 40.0),
        Window("during", 10.0, 9000, non_200, errors, 80.0),
        Window("after", 5.0, 4000, 0, 0, 41.0),
    ]
    return Swap(1, 2, windows, switch, 300, ["hey"])


def test_the_verdict_counts_every_failed_request():
    clean = Switch(0.9, 0.8, 0, 0)
    assert swap(clean).passed and swap(clean).failed == 0
    assert swap(clean, non_200=3, errors=1).failed == 4 and not swap(clean, non_200=3).passed
    assert swap(Switch(0.9, 0.8, 0, 2)).failed == 2
    assert not swap(Switch(0.9, 1.2, 1, 0)).passed  # went back to version 1
    never = swap(Switch(None, 5.0, 0, 0))
    assert not never.passed and "no answer ever came from version 2" in never.markdown()
    assert "| during | 10.0 | 9000 | 3 | 1 | 80.0 |" in swap(clean, 3, 1).markdown()


def test_stage_copies_the_newest_version_out_of_sight_then_renames_it_in(tmp_path):
    model = tmp_path / "models" / "m"
    for version in (1, 3):
        (model / str(version)).mkdir(parents=True)
        (model / str(version) / "model.onnx").write_bytes(b"v%d" % version)
    (model / "labels.txt").write_text("a\n")
    (tmp_path / "staging").mkdir()
    old, new, publish = stage(model, tmp_path / "staging")
    assert (old, new) == (3, 4)
    assert not (model / "4").exists()  # staged, not yet visible to the service
    publish()
    assert (model / "4" / "model.onnx").read_bytes() == b"v3"
    assert not (tmp_path / "staging" / "4").exists()  # moved, not copied
