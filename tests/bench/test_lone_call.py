"""bench/lone_call.py's plan and arithmetic (no server starts here)."""

from __future__ import annotations

from bench import hey, lone_call


def stats(count: int, success_ns: int, queue_ns: int, input_ns: int, infer_ns: int) -> dict:
    """One model's ``inference_stats`` as /v2/models/{name}/stats answers it (the parts read)."""
    return {
        "success": {"count": count, "ns": success_ns},
        "queue": {"count": count, "ns": queue_ns},
        "compute_input": {"count": count, "ns": input_ns},
        "compute_infer": {"count": count, "ns": infer_ns},
    }


def test_each_part_is_the_growth_of_its_total_over_the_requests_in_between():
    before = stats(10, 20_000_000, 500_000, 100_000, 15_000_000)
    after = stats(110, 180_000_000, 5_500_000, 2_100_000, 135_000_000)
    # 100 requests: 160 ms of success, 5 ms queued, 2 ms stacking, 120 ms in the model
    assert lone_call.per_request_us(before, after) == {
        "success": 1600.0,
        "queue": 50.0,
        "input": 20.0,
        "infer": 1200.0,
    }


def test_no_request_in_between_gives_no_parts():
    same = stats(10, 1, 1, 1, 1)
    assert lone_call.per_request_us(same, same) is None


def test_the_plain_server_then_vitserve_in_one_process_with_one_front_end_and_the_default():
    plan = lone_call.contenders(workers=2)
    assert [s.key for s in plan] == ["plain", "w0", "w1", "w2"]
    assert plan[0].settings is None and "plain_onnx_server" in " ".join(plan[0].argv)
    assert [s.settings for s in plan[1:]] == [{"workers": "0"}, {"workers": "1"}, {"workers": "2"}]
    # on one core the default is one front end: not run twice
    assert [s.key for s in lone_call.contenders(workers=1)] == ["plain", "w0", "w1"]


def test_the_summary_holds_medians_and_leaves_the_plain_server_s_parts_empty():
    def result(rps: float, p50_s: float) -> hey.HeyResult:
        return hey.HeyResult(100 / rps, rps, None, {50: p50_s}, {200: 100}, {})

    parts = {"success": 1500.0, "queue": 50.0, "input": 20.0, "infer": 1200.0}
    text = lone_call.summary(
        {
            "plain": [(result(300, 0.003), None), (result(340, 0.0028), None)],
            "w1": [(result(290, 0.0035), parts), (result(310, 0.0033), parts)],
        }
    )
    lines = text.splitlines()
    assert lines[0].startswith("| server | req/s | p50 ms | success µs")
    assert lines[2] == "| plain | 320 (300-340) | 2.90 (2.80-3.00) | - | - | - | - | 0 |"
    assert lines[3].startswith("| w1 | 300 (290-310) | 3.40 (3.30-3.50) | 1,500 (1,500-1,500) |")
