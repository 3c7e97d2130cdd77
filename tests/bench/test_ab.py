"""bench/ab.py: the alternation that spreads the machine's drift over both trees, and its table, on
real hey output (tests/bench/fixtures)."""

from __future__ import annotations

from pathlib import Path

from bench import ab, hey
from bench.stats import alternated

FIXTURES = Path(__file__).parent / "fixtures"


def test_each_tree_goes_first_in_every_other_round():
    assert [alternated(["before", "after"], n) for n in range(4)] == [
        ["before", "after"],
        ["after", "before"],
        ["before", "after"],
        ["after", "before"],
    ]


def test_the_table_gives_each_tree_its_median_and_every_round():
    mixed = hey.parse_summary((FIXTURES / "hey-mixed.txt").read_text())
    runs = [mixed, mixed, mixed]
    text = ab.summary({(64, "before"): runs, (64, "after"): runs[:1]})
    before, after = (line for line in text.splitlines() if line.startswith("| 64"))
    rps = f"{mixed.ok_rps:,.0f}"
    assert before.split(" | ")[1] == "before" and after.split(" | ")[1] == "after"
    assert f"{rps}, {rps}, {rps}" in before  # every round, in the order run
    bad = mixed.not_ok + mixed.error_count
    assert before.rstrip(" |").endswith(str(3 * bad)) and after.rstrip(" |").endswith(str(bad))
