"""The target probe of ``bench.reliability.kills_under_load``, short: 12 s under 8 clients with its four
kills (a front end twice, the engine twice, the second time during its restart), then SIGTERM. Every
answer is a 200 or a 503 with Retry-After, every kill recovers (the probe gives up after 60 s), the
service exits 0, and nothing is left in /dev/shm or its TMPDIR. RELIABILITY.md has the 60 s runs;
nothing here is timed."""

from __future__ import annotations

import pytest

from bench.reliability.kills_under_load import measure

pytestmark = pytest.mark.timeout(300)


def test_four_kills_under_load_lose_only_dropped_connections_and_leave_nothing(tmp_path):
    result = measure(clients=8, duration_s=12.0, workers=2, log=tmp_path / "server.log")
    assert result["unexpected_answers"] == [], (tmp_path / "server.log").read_text()[-3000:]
    assert [kill["killed"] for kill in result["kills"]] == [
        "front end",
        "engine",
        "front end",
        "engine, then its replacement while it loaded",
    ]
    assert result["kills"][-1]["replacement_ready_when_killed"] is False
    assert result["answered_200"] > 0 and result["answered_503"] > 0
    # a killed front end drops the requests on its connections: at most one per client, twice
    assert result["requests_lost"] <= 2 * 8, result["lost"]
    assert result["exit_code"] == 0
    assert result["left_in_dev_shm"] == [] and result["left_in_tmpdir"] == []
