"""Parsing hey's summary, on real hey 0.1.4 output (tests/bench/fixtures/record.py), and its
command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import hey

FIXTURES = Path(__file__).parent / "fixtures"


def parsed(name: str) -> hey.HeyResult:
    return hey.parse_summary((FIXTURES / name).read_text())


def test_statuses_errors_and_percentiles_of_a_mixed_run():
    result = parsed("hey-mixed.txt")  # hey -n 400 against a server answering 200, 503 or nothing
    assert result.status_codes == {200: 308, 503: 87}
    assert result.errors == {'Post "http://127.0.0.1:18190/predict": EOF': 5}
    assert result.ok + result.not_ok + result.error_count == 400  # every request hey was asked for
    assert result.percentiles_s == {
        10: 0.0032,
        25: 0.0036,
        50: 0.0043,
        75: 0.0056,
        90: 0.0080,
        95: 0.0123,
        99: 0.0307,
    }
    assert result.total_s == pytest.approx(0.5486)
    assert result.ok_rps == pytest.approx(308 / 0.5486)
    assert result.rps > result.ok_rps  # hey's own figure counts the 503s too
    assert result.ms(99) == pytest.approx(30.7)


def test_percentiles_hey_has_too_few_answers_for_are_missing_not_zero():
    text = (FIXTURES / "hey-few.txt").read_text()
    assert "  0% in 0.0000 secs" in text  # how hey 0.1.4 prints a percentile it cannot compute
    result = hey.parse_summary(text)
    assert result.ok + result.not_ok == 20
    assert set(result.percentiles_s) == {10, 25, 50, 75, 90, 95}
    assert result.ms(99) is None


def test_a_run_where_every_request_failed():
    result = parsed("hey-refused.txt")
    assert result.status_codes == {} and result.percentiles_s == {}
    assert result.average_s is None and result.ok_rps == 0.0
    assert result.error_count == 50
    assert "connection refused" in next(iter(result.errors))


def test_not_a_summary_is_an_error():
    with pytest.raises(hey.HeyError, match="not a hey summary"):
        hey.parse_summary("hey: unknown flag -x\n")


def test_command_fixed_duration_post_of_a_json_file():
    argv = hey.command("http://h:1/predict", Path("/tmp/b.json"), concurrency=64, duration_s=5)
    assert argv == [
        *("hey", "-z", "5s", "-c", "64", "-t", "30", "-m", "POST"),
        *("-T", "application/json", "-D", "/tmp/b.json", "http://h:1/predict"),
    ]
    assert hey.shown(argv).startswith("GOMAXPROCS=1 hey -z 5s")
    assert " -D b.json " in hey.shown(argv)


def test_command_takes_exactly_one_amount():
    assert hey.command("http://h/p", Path("b"), concurrency=8, requests=200)[1:3] == ["-n", "200"]
    with pytest.raises(ValueError, match="exactly one"):
        hey.command("http://h/p", Path("b"), concurrency=8)
    with pytest.raises(ValueError, match="exactly one"):
        hey.command("http://h/p", Path("b"), concurrency=8, requests=1, duration_s=1)


def test_a_failing_hey_is_an_error_with_its_message():
    with pytest.raises(hey.HeyError, match="hey exited"):
        hey.run(["hey", "-no-such-flag", "http://127.0.0.1:18199/"], wall_limit_s=30)
