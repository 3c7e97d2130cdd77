"""``export.onnx --candidate``: a new version that starts as the served version's candidate.

Its trial is written into config.pbtxt before its directory appears, so that a service polling the
repository never serves the new version live first (the trial the feature exists for); the plan it
writes is read back with the service's own reader.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from export import repository
from export.repository import RepositoryError
from service.contract.candidate_plan import CandidatePlan, candidate_plan, with_trial
from service.contract.model_config import ModelConfigError, read_model_config, select_versions
from tests.export.test_onnx_export import write


def policy_versions(config) -> list[int]:
    return list(config.version_policy.specific.versions)


def test_the_trial_pins_the_served_version_and_keeps_both_loaded(tmp_path):
    write(tmp_path, 1)
    write(tmp_path, 2, candidate=True)
    config = read_model_config(tmp_path / "m" / "config.pbtxt")
    assert candidate_plan(config) == CandidatePlan(
        live_version=1, candidate_version=2, shadow_percent=100.0
    )
    assert policy_versions(config) == [1, 2]


def test_the_config_names_the_candidate_before_its_directory_appears(tmp_path, monkeypatch):
    write(tmp_path, 1)
    seen: list[CandidatePlan] = []
    rename = os.rename

    def watched(source, target):
        if Path(target) == tmp_path / "m" / "2":  # the moment a polling service could see it
            seen.append(candidate_plan(read_model_config(tmp_path / "m" / "config.pbtxt")))
        rename(source, target)

    monkeypatch.setattr(repository.os, "rename", watched)
    write(tmp_path, 2, candidate=True)
    assert [(p.live_version, p.candidate_version) for p in seen] == [(1, 2)]


def test_without_candidate_the_new_version_is_served_as_before(tmp_path):
    write(tmp_path, 1)
    write(tmp_path, 2)
    config = read_model_config(tmp_path / "m" / "config.pbtxt")
    assert candidate_plan(config).candidate_version is None


def test_a_second_trial_and_a_trial_with_nothing_served_are_refused(tmp_path):
    with pytest.raises(RepositoryError, match="serves no version to try version 1 against"):
        write(tmp_path, 1, candidate=True)
    assert not (tmp_path / "m" / "1").exists()
    write(tmp_path, 1)
    write(tmp_path, 2, candidate=True)
    with pytest.raises(
        RepositoryError,
        match=re.escape(
            "already trying version 2 (vitserve_candidate_version); promote it or roll"
        ),
    ):
        write(tmp_path, 3, candidate=True)
    assert not (tmp_path / "m" / "3").exists()


@pytest.mark.parametrize(
    ("policy", "live", "served"),
    [
        (("latest", 1), 3, [3, 4]),  # the default: the newest served, then the candidate too
        (("latest", 2), 3, [2, 3, 4]),
        (("specific", (1,)), 1, [1, 4]),  # a pinned version stays the live one
        (("all",), 3, None),  # every version is served already: the policy is kept
    ],
)
def test_the_trial_keeps_what_the_policy_served(policy, live, served):
    config = read_model_config_text(policy)
    trial = with_trial(config, [1, 2, 3], 4)
    plan = candidate_plan(trial)
    assert (plan.live_version, plan.candidate_version) == (live, 4)
    if served is None:
        assert trial.version_policy.WhichOneof("policy_choice") == "all"
    else:
        assert policy_versions(trial) == served
        assert select_versions(("specific", tuple(served)), [1, 2, 3, 4]) == served


def read_model_config_text(policy: tuple):
    from service.contract.model_config import ModelConfig

    config = ModelConfig(name="m")
    if policy[0] == "latest":
        config.version_policy.latest.num_versions = policy[1]
    elif policy[0] == "specific":
        config.version_policy.specific.versions[:] = list(policy[1])
    else:
        config.version_policy.all.SetInParent()
    return config


def test_a_pinned_live_version_is_kept_and_a_share_already_set_is_kept():
    config = read_model_config_text(("specific", (1, 2, 3)))
    config.parameters["vitserve_live_version"].string_value = "2"  # as a promotion writes it
    config.parameters["vitserve_canary_percent"].string_value = "5"
    config.parameters["vitserve_candidate_version"].string_value = "3"
    config.parameters["vitserve_shadow_percent"].string_value = "20"
    with pytest.raises(ModelConfigError, match="already trying version 3"):
        with_trial(config, [1, 2, 3], 4)
    del config.parameters["vitserve_candidate_version"]
    del config.parameters["vitserve_canary_percent"]
    del config.parameters["vitserve_shadow_percent"]
    plan = candidate_plan(with_trial(config, [1, 2, 3], 4))
    assert (plan.live_version, plan.candidate_version, plan.shadow_percent) == (2, 4, 100.0)


def test_an_int8_graphs_offline_agreement_is_what_a_shadow_would_measure():
    """Computed here by hand on three images of three classes: one top-1 moves, and the largest
    probability differences are those of the softmax of each row."""
    from export.quantize import agreement

    float_logits = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    int8_logits = np.array([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    e = math.e
    second = (e / (e + 2)) - (1 / (e + 2))  # class 0 and class 1 swap their probabilities
    third = e**3 / (e**3 + 2) - e**2 / (e**2 + 2)
    got = agreement(float_logits, int8_logits)
    assert got["top1_agreement"] == pytest.approx(2 / 3)
    assert got["probability_difference_max"] == pytest.approx(max(second, third))
    assert got["probability_difference_p99"] == pytest.approx(
        np.percentile([0.0, second, third], 99)
    )
