"""Parsing hey's summary (Debian's hey 0.1.4 prints this layout) and building its command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.hey import HeyError, command, parse_summary

SUMMARY = """
Summary:
  Total:\t2.0380 secs
  Slowest:\t0.0597 secs
  Fastest:\t0.0169 secs
  Average:\t0.0517 secs
  Requests/sec:\t76.5473
\x20\x20
  Total data:\t1248 bytes
  Size/request:\t8 bytes

Response time histogram:
  0.017 [1]\t|
  0.055 [135]\t|\u25a0\u25a0\u25a0\u25a0

Latency distribution:
  10% in 0.0518 secs
  25% in 0.0519 secs
  50% in 0.0520 secs
  75% in 0.0522 secs
  90% in 0.0558 secs
  95% in 0.0560 secs
  99% in 0.0597 secs

Details (average, fastest, slowest):
  DNS+dialup:\t0.0000 secs, 0.0169 secs, 0.0597 secs
  resp read:\t0.0402 secs, 0.0000 secs, 0.0451 secs

Status code distribution:
  [200]\t124 responses
  [503]\t32 responses

Error distribution:
  [3]\tPost "http://127.0.0.1:18110/predict": EOF
  [1]\tPost "http://127.0.0.1:18110/predict": read: connection reset by peer
"""

ALL_ERRORS = """
Summary:
  Total:\t1.0019 secs
  Slowest:\t0.0000 secs
  Fastest:\t0.0000 secs
  Average:\t NaN secs
  Requests/sec:\t8120.5521

Latency distribution:

Details (average, fastest, slowest):
  DNS+dialup:\t NaN secs, 0.0000 secs, 0.0000 secs

Status code distribution:

Error distribution:
  [8136]\tPost "http://127.0.0.1:18150/x": dial tcp 127.0.0.1:18150: connect: connection refused
"""


def test_summary_counts_statuses_errors_and_percentiles():
    result = parse_summary(SUMMARY)
    assert result.total_s == pytest.approx(2.038)
    assert result.rps == pytest.approx(76.5473)
    assert result.percentiles_s == {
        10: 0.0518,
        25: 0.0519,
        50: 0.0520,
        75: 0.0522,
        90: 0.0558,
        95: 0.0560,
        99: 0.0597,
    }
    assert result.status_codes == {200: 124, 503: 32}
    assert result.ok == 124 and result.not_ok == 32 and result.error_count == 4
    assert len(result.errors) == 2


def test_ok_rps_counts_only_200_answers_over_hey_total_time():
    result = parse_summary(SUMMARY)
    assert result.ok_rps == pytest.approx(124 / 2.038)
    assert result.ok_rps < result.rps  # hey's own figure includes the 503s


def test_summary_where_every_request_failed():
    result = parse_summary(ALL_ERRORS)
    assert result.average_s is None
    assert result.percentiles_s == {} and result.status_codes == {}
    assert result.ok == 0 and result.ok_rps == 0.0
    assert result.error_count == 8136


def test_missing_percentiles_stay_missing():
    """hey prints no p99 with fewer than 100 answers; it must not read as 0 ms."""
    text = SUMMARY.replace("  99% in 0.0597 secs\n", "").replace("  95% in 0.0560 secs\n", "")
    result = parse_summary(text)
    assert 99 not in result.percentiles_s and 95 not in result.percentiles_s
    assert result.percentiles_s[90] == 0.0558


def test_to_dict_is_json_friendly():
    data = parse_summary(SUMMARY).to_dict()
    assert data["status_codes"] == {"200": 124, "503": 32}
    assert data["percentiles_s"]["99"] == 0.0597
    assert data["ok_rps"] == pytest.approx(124 / 2.038)


def test_not_a_summary_is_an_error():
    with pytest.raises(HeyError):
        parse_summary("hey: unknown flag -x\n")


def test_command_fixed_duration_post_of_a_json_file():
    argv = command(
        "http://127.0.0.1:18110/predict", Path("/tmp/b.json"), concurrency=64, duration_s=5
    )
    assert argv == [
        "hey",
        "-z",
        "5s",
        "-c",
        "64",
        "-t",
        "30",
        "-m",
        "POST",
        "-T",
        "application/json",
        "-D",
        "/tmp/b.json",
        "http://127.0.0.1:18110/predict",
    ]


def test_command_fixed_count_and_exactly_one_amount():
    argv = command("http://h/p", Path("b"), concurrency=8, requests=200)
    assert argv[1:3] == ["-n", "200"]
    with pytest.raises(ValueError, match="exactly one"):
        command("http://h/p", Path("b"), concurrency=8)
    with pytest.raises(ValueError, match="exactly one"):
        command("http://h/p", Path("b"), concurrency=8, requests=1, duration_s=1)
