"""JSON bombs against a real server (docs/decisions.md#slow-and-greedy-clients): four concurrent 15 MiB bodies of nested arrays are all
refused 4xx, the server's peak memory grows by less than 200 MiB, and liveness keeps answering.

The driver is ``tests/reliability/json_bombs.py``; its latency figures are in RELIABILITY.md (speed
is measured there, not asserted here)."""

from __future__ import annotations

import pytest

from tests.reliability.json_bombs import SIZE, measure
from tests.support import RELIABILITY, running_server

pytestmark = pytest.mark.slow  # about 15 s


def test_four_concurrent_json_bombs_are_refused_within_bounded_memory(model_repository, tmp_path):
    with running_server(
        model_repository,
        tmp_path / "service.log",
        suite=RELIABILITY,
        max_body_bytes=SIZE + 1024 * 1024,
    ) as server:
        result = measure(server.url, server.process.pid)
        assert server.process.poll() is None, server.output()
    assert [answer["status"] for answer in result["answers"]] == [413] * 4, result
    assert {answer["code"] for answer in result["answers"]} == {"too_many_json_values"}
    assert all(answer["bytes"] > 15_000_000 for answer in result["answers"])
    assert result["peak_reset"], "cannot reset the peak RSS of the server (/proc/PID/clear_refs)"
    assert result["peak_rss_growth_mib"] < 200, result
    assert result["liveness_failures"] == [] and result["liveness_probes"] >= 5, result
