"""bench/int8_trial.py's logic and its report (bench/int8_trial_report.py), no server and no
timing: the trial's photos, when the agreement alone refuses the candidate, the promotion commands
as shown, and the section it prints."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench import int8_trial, int8_trial_report
from bench.int8_trial_report import FLOAT, INT8, Promotion, Trial, Window
from service.contract.candidates import Thresholds


def test_crops_are_four_by_three_inside_the_photo_and_at_least_half_its_largest():
    rng = np.random.default_rng(1)
    boxes = int8_trial.crop_boxes(300, 500, 200, rng)
    assert len(boxes) == 200 and len(set(boxes)) > 150
    for left, top, right, bottom in boxes:
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 300
        w, h = right - left, bottom - top
        assert abs(w / h - 4 / 3) < 0.02
        assert 200 <= w <= 400  # the largest 4:3 box of 500 x 300 is 400 x 300
    tall = int8_trial.crop_boxes(600, 200, 50, rng)  # a portrait photo: width bounds the box
    assert all(right - left <= 200 for left, _, right, _ in tall)


def test_trial_photos_are_distinct_seeded_jpegs_of_every_photo():
    rng = np.random.default_rng(0)
    photos = {n: rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for n in ("a", "b", "c")}
    jpegs = int8_trial.trial_photos(photos, 7, seed=3, size=(64, 48))
    assert len(jpegs) == 7 and len(set(jpegs)) == 7
    assert jpegs == int8_trial.trial_photos(photos, 7, seed=3, size=(64, 48))
    assert jpegs != int8_trial.trial_photos(photos, 7, seed=4, size=(64, 48))
    for jpeg in jpegs:
        image = Image.open(io.BytesIO(jpeg))
        assert (image.format, image.size) == ("JPEG", (64, 48))


def report(compared=200, agreement=0.6, latency=0.6, p99=0.001):
    pair = {
        "live_version": 1,
        "candidate_version": 2,
        "requests_compared": compared,
        "top1_agreement": agreement,
        "probability_difference": {"mean": 0.0004, "p99": p99},
        "model_ms": {"ratio_p50": latency, "pairs": 120, "live_p50": 100.0, "candidate_p50": 60.0},
        "confusion": [
            {"live_class": 3, "candidate_class": 3, "images": 5},
            {"live_class": 3, "candidate_class": 7, "images": 2},
            {"live_class": 9, "candidate_class": 1, "images": 1},
        ],
        "outcomes": {"compared": compared, "shed": 4},
    }
    stale = {**pair, "live_version": 0, "top1_agreement": 1.0}  # an earlier trial's pair
    return {"model": "vit-small", "live_version": 1, "candidate_version": 2, "pairs": [stale, pair]}


@pytest.mark.parametrize(
    ("got", "accepted"),
    [
        (report(), True),  # agreement alone: a user may accept it
        (report(latency=1.2), False),  # slower too: never promoted for being int8
        (report(agreement=0.99), False),  # nothing refused
        (report(compared=50), False),  # not enough evidence yet
        (report(p99=0.5), True),  # no p99 threshold asked
    ],
)
def test_only_a_refusal_on_agreement_alone_is_accepted(got, accepted):
    thresholds = Thresholds(0.97, 200, 1.0, None)
    assert int8_trial.refused_on_agreement_only(got, thresholds) is accepted


def test_the_shadow_pair_is_the_current_one_and_its_confusion_is_summed_up():
    pair = int8_trial_report.shadow_pair(report())
    assert (pair["live_version"], pair["top1_agreement"]) == (1, 0.6)
    assert int8_trial_report.shadow_pair({"pairs": []}) == {}
    compact = int8_trial.compact(report())
    assert compact["pairs"][1]["confusion"] == "3 live -> candidate classes; 3 images changed class"
    assert compact["pairs"][1]["top1_agreement"] == 0.6


def test_promotion_is_shown_as_typed_without_the_port():
    argv = int8_trial.promote_argv("http://127.0.0.1:18201", "vit-small", 0.97, 200, 1.0, True)
    assert int8_trial_report.shown(argv) == (
        "python -m service.promote --url URL --model vit-small --min-agreement 0.97 "
        "--min-requests 200 --max-latency-ratio 1 --dry-run"
    )
    log = (
        "2026-11-29 11:37:35,057 INFO vit-small: waiting\n"
        "2026-11-29 11:37:46,738 WARNING vit-small: ...: promoted; live version 1 -> 2"
    )
    assert int8_trial_report.last_line(log) == "vit-small: ...: promoted; live version 1 -> 2"


def test_the_section_gives_the_shadows_numbers_the_promotion_and_int8_over_float():
    promotions = [Promotion(["python", "-m", "service.promote", "--url", "http://x:1"], 4, "a b")]
    trial = Trial(
        "small",
        {
            "images": 8,
            "top1_agreement": 0.75,
            "probability_difference_p99": 5e-4,
            "probability_difference_max": 6e-4,
        },
        report(),
        210,
        0,
        promotions,
        2,
    )
    for repeat, (float_rate, int8_rate) in enumerate([(10.0, 15.0), (12.0, 20.0)]):
        float_cpu = {"engine": 150.0 + repeat, "front end": 15.0, "supervisor": 0.1}
        int8_cpu = {"engine": 100.0 + repeat, "front end": 15.0 + 2 * repeat}
        trial.windows.append(Window(FLOAT, repeat, float_rate, 900, 1000, 0, 0.5, float_cpu, 7.5))
        trial.windows.append(Window(INT8, repeat, int8_rate, 600, 700, 0, 1.5, int8_cpu, None))
    text = trial.markdown()
    assert "## An int8 ViT-S/16 promoted through the shadow" in text
    assert "200 compared, top-1 agreement 0.6000" in text
    assert "model time ratio 0.600 over 120 timed pairs of shadow batches" in text
    assert "(a batch's p50: live 100 ms, candidate 60 ms)" in text
    assert "- `python -m service.promote --url URL`: exit 4: a b" in text
    assert "answered by version 2 after it" in text
    assert (
        "| float (version 1) | 11.0 (10.0-12.0) | 900 (900-900) | 1,000 (1,000-1,000) "
        "| 150.5 (150.0-151.0) | 15.0 (15.0-15.0) | 7.5 (7.5-7.5) | 0 |" in text
    )
    assert "| 100.5 (100.0-101.0) | 16.0 (15.0-17.0) | - | 0 |" in text
    # 17.5 / 11.0; 700 / 1000; CPU a image as a speed: 150.5 / 100.5 and 15 / 16
    assert "| int8 / float | 1.59x |  | 0.70x | 1.50x | 0.94x |  |  |" in text
    header = "| version | images/s | p50 ms | p99 ms | engine CPU ms | front end CPU ms | images a batch |"
    assert f"{header} failed |" in text
    assert "supervisor" not in text
    assert "other processes used 1.00 (0.50-1.50) cores" in text


@pytest.mark.parametrize("argv", [["--compare", "0"], ["--seconds", "0"], ["--size", "base"]])
def test_bad_options_are_refused_before_anything_runs(argv, monkeypatch):
    monkeypatch.setattr(int8_trial, "run", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exited:
        int8_trial.main(argv)
    assert exited.value.code == 2
