"""bench/ab.py: the alternation that spreads the machine's drift over both trees, and its table, on
real hey output (tests/bench/fixtures)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

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


def test_starts_alternate_the_trees_one_at_a_time_and_table_every_start(monkeypatch, tmp_path):
    """``--starts``: each tree's service started in turn (never two up at once), its seconds to
    ready in the table, in the order run, with the median first."""
    order, up = [], []
    seconds = iter([2.0, 3.0, 3.5, 2.5, 2.2, 3.1])

    @contextlib.contextmanager
    def running(argv, env, log, *, ports, cwd, **_):
        assert not up, "two services up at once"
        order.append(Path(cwd).name)
        up.append(cwd)
        try:
            yield SimpleNamespace(ready_s=next(seconds))
        finally:
            up.pop()

    monkeypatch.setattr(ab, "running", running)
    trees = {"before": tmp_path / "old", "after": tmp_path / "new"}
    text = ab.starts(trees, 3, tmp_path)
    assert order == ["old", "new", "new", "old", "old", "new"]
    before, after = (line for line in text.splitlines() if line.startswith(("| before", "| after")))
    assert "2.00, 2.50, 2.20" in before and before.split(" | ")[1].startswith("2.20")
    assert "3.00, 3.50, 3.10" in after and after.split(" | ")[1].startswith("3.10")
