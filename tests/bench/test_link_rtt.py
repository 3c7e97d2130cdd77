"""bench/link_rtt.py: each link echoes what it is sent (checked in the warm-up), and every round trip
is timed."""

from __future__ import annotations

import pytest

from bench import link_rtt


@pytest.mark.parametrize("kind", link_rtt.KINDS)
def test_each_link_answers_every_round_trip(kind):
    seconds = link_rtt.round_trips(kind, trips=20, size=64, gap_s=0.001)
    assert len(seconds) == 20 and seconds == sorted(seconds)
    assert seconds[0] > 0 and seconds[-1] < 5


def test_the_command_prints_each_link(capsys):
    link_rtt.main(["--trips", "10", "--size", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["zmq.asyncio", "zmq", "link"]
