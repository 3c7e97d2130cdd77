"""The issue's targets as PASS / FAIL / NOT MEASURED, and the document around them."""

from __future__ import annotations

from bench.report import engine_section, paired_wins, render, targets
from bench.stats import summarize


def _level(rps, p99, images=None, busy=0):
    return {
        "ok_rps": summarize([rps]),
        "images_per_s": summarize([images if images is not None else rps]),
        "p50_ms": summarize([p99 / 2]),
        "p90_ms": summarize([p99]),
        "p99_ms": summarize([p99]),
        "avg_batch_size": summarize([]),
        "status_codes": {"200": 100},
        "errors": 0,
        "not_ok": 0,
        "busy_runs": busy,
        "runs": 1,
    }


def _service(
    service_rps=900,
    baseline_rps=200,
    nobatch_rps=500,
    service_p99=50.0,
    baseline_p99=400.0,
    batch32=2000,
    ceiling=2500,
    startup=(1.5, 1.7, 1.6),
    peak_kib=200 * 1024,
    busy=0,
):
    return {
        "summary": {
            "batching": {
                "label": "b",
                "levels": {"64": _level(service_rps, service_p99, busy=busy)},
            },
            "no-batching": {"label": "n", "levels": {"64": _level(nobatch_rps, 90.0)}},
            "baseline": {"label": "x", "levels": {"64": _level(baseline_rps, baseline_p99)}},
            "batch32": {
                "label": "32",
                "levels": {
                    "16": _level(batch32 / 32, 500, images=batch32),
                    "64": _level(batch32 / 64, 900, images=batch32 / 2),
                },
            },
        },
        "ceiling_images_per_s": summarize([ceiling]),
        "startup_s": {"service": summarize(list(startup))},
        "memory_kib": {"service": {"VmRSS": peak_kib - 1024, "VmHWM": peak_kib}},
        "points": [],
        "duration_s": 5,
        "repeats": 1,
    }


def _engine(classifier=1000.0, attention=900.0):
    return {
        "classifier_vs_attention": {
            "32": {
                "model.onnx": summarize([classifier]),
                "attention.onnx": summarize([attention]),
                "classifier_over_attention": summarize([classifier / attention]),
            }
        }
    }


def _verdicts(rows):
    return [r["verdict"] for r in rows]


def test_all_targets_pass():
    rows = targets(_engine(), _service())
    assert _verdicts(rows) == ["PASS"] * 7
    assert "4.50x" in rows[0]["measured"]
    assert "c=16" in rows[3]["measured"]  # the best concurrency of the 32-image case
    assert not any(r["busy"] for r in rows)


def test_each_target_can_fail():
    rows = targets(
        _engine(classifier=800, attention=1000),
        _service(
            service_rps=500,
            baseline_rps=200,
            nobatch_rps=450,
            service_p99=500.0,
            batch32=1000,
            startup=(4.0, 6.0, 4.5),
            peak_kib=400 * 1024,
        ),
    )
    assert _verdicts(rows) == ["FAIL"] * 7


def test_attention_target_tolerates_timing_noise():
    rows = targets(_engine(classifier=990, attention=1000), _service())
    assert rows[-1]["verdict"] == "PASS"


def test_nothing_measured():
    assert set(_verdicts(targets(None, None))) == {"NOT MEASURED"}


def test_busy_runs_mark_the_targets_they_feed():
    rows = targets(_engine(), _service(busy=1))
    assert rows[0]["busy"] and rows[2]["busy"]
    assert not rows[-1]["busy"]


def test_render_has_banners_targets_and_the_cuda_section():
    results = {
        "meta": {
            "quick": True,
            "command": "python -m bench --quick",
            "failures": {"micro": "boom"},
            "busy_at_start": {"busy": True, "describe": "2 cores busy"},
        },
        "engine": _engine(),
        "service": {
            **_service(),
            "busy_runs": 3,
            "points": [
                {
                    "case": "batching",
                    "command": "hey -z 5s -c 64 -D /tmp/vitserve-bench-x/single.json URL",
                }
            ]
            * 5,
        },
    }
    text = render(results)
    assert "SMOKE RUN" in text and "MACHINE WAS BUSY" in text and "micro FAILED" in text
    assert "python -m bench --quick" in text
    assert "## Targets (issue 5)" in text and "PASS" in text
    assert "## The CUDA path (not measured)" in text
    assert "No GPU was available" in text
    assert "`hey -z 5s -c 64 -D single.json URL`" in text  # temporary paths shortened


def test_attention_pairs_report_how_many_repeats_each_graph_won():
    pair = _engine()["classifier_vs_attention"]["32"]
    # Medians favour attention.onnx while model.onnx wins 2 of 3 pairs: the report must show both.
    pair["samples"] = {
        "model.onnx": [1000.0, 900.0, 1200.0],
        "attention.onnx": [950.0, 1300.0, 1100.0],
    }
    assert paired_wins(pair) == "2 of 3"
    measured = targets({"classifier_vs_attention": {"32": pair}}, _service())[6]["measured"]
    assert "model.onnx faster in 2 of 3 repeats" in measured
    assert paired_wins({"model.onnx": summarize([1.0])}) is None


def test_classifier_exports_table_marks_the_shipped_export():
    shipped, other = "explicit (shipped)", "sdpa opset 18"

    def variant(rate, over, wins):
        return {
            "images_per_s": summarize([rate]),
            "over_shipped": summarize([over]),
            "wins_over_shipped": wins,
            "repeats": 3,
            "max_abs_diff_vs_shipped": 0.0,
        }

    exports = {
        "shipped": shipped,
        "nodes": {shipped: 199, other: 253},
        "batches": {"32": {shipped: variant(1300, 1.0, 0), other: variant(1200, 0.92, 1)}},
    }
    text = "\n".join(engine_section({"classifier_exports": exports}))
    assert "### How the classifier graph is exported" in text
    assert f"| 32 | {shipped} | 199 | 1,300 | 1 | - |" in text
    assert f"| 32 | {other} | 253 | 1,200 | 0.920 | 1 of 3 |" in text
