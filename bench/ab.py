"""Two checkouts of vitserve side by side: ``python -m bench.ab BEFORE AFTER``.

For a change whose effect is smaller than the machine's drift between two runs: both servers run at
once, each from its own tree with its defaults (the commit before, say, in a worktree with the venv
linked in: ``git worktree add --detach ../before HEAD~1 && ln -s "$PWD/.venv" ../before/.venv``),
and ``hey`` alternates between them, BEFORE first in even rounds and AFTER first in odd ones, so that
drift falls on both. Single base64 PNG requests to /predict, as bench/compare.py sends them.

    python -m bench.ab ../before . [--concurrency 1,64] [--rounds 4] [--seconds 8] [--starts 0]

Prints, per concurrency, each tree's median req/s, p50 and p99 over the rounds, and every round's
req/s. ``--starts N`` first starts each tree's service N times, alternated, one at a time, and prints
each one's seconds from spawn to the first 200 of /health/ready (``--concurrency ''`` for those
alone). BENCHMARKS.md quotes it where a change was measured this way.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import hey
from bench.payloads import b64_pngs, predict_body
from bench.server_process import RunningServer, running, service_env
from bench.stats import Spread, alternated, table

PORTS = range(18160, 18180)


def summary(results: dict[tuple[int, str], list[hey.HeyResult]]) -> str:
    """A Markdown table: per (concurrency, tree), the median req/s, p50 and p99, and each round's
    req/s in the order run."""
    rows = []
    for (concurrency, name), runs in results.items():
        rps = Spread.of(r.ok_rps for r in runs)
        p50 = Spread.of(r.ms(50) for r in runs)
        p99 = Spread.of(r.ms(99) for r in runs)
        rows.append(
            [
                str(concurrency),
                name,
                rps.text() if rps else "-",
                p50.text(2) if p50 else "-",
                p99.text(1) if p99 else "-",
                ", ".join(f"{r.ok_rps:,.0f}" for r in runs),
                str(sum(r.not_ok + r.error_count for r in runs)),
            ]
        )
    return table(["c", "tree", "req/s", "p50 ms", "p99 ms", "each round's req/s", "not 200"], rows)


def service_argv(tree: Path) -> list[str]:
    """``python -m service`` with the tree's own virtual environment."""
    return [str(tree / ".venv" / "bin" / "python"), "-m", "service"]


def serve_trees(
    stack: contextlib.ExitStack,
    trees: dict[str, Path],
    scratch: Path,
    env: Callable[[int], dict[str, str]],
) -> dict[str, RunningServer]:
    """Each tree's service running on a port of PORTS, stopped when ``stack`` closes."""
    return {
        name: stack.enter_context(
            running(
                service_argv(tree),
                env,
                scratch / f"{name}.log",
                ports=PORTS,
                start=index * 10,
                name=f"{name} ({tree})",
                cwd=tree,
            )
        )
        for index, (name, tree) in enumerate(trees.items())
    }


def starts(trees: dict[str, Path], count: int, scratch: Path) -> str:
    """Start each tree's service ``count`` times, alternated, one at a time; a Markdown table of
    their seconds from spawn to ready."""
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    for round_number in range(count):
        for name in alternated(list(trees), round_number):
            tree = trees[name]
            log = scratch / f"{name}-start-{round_number}.log"
            with running(service_argv(tree), service_env, log, ports=PORTS, cwd=tree) as server:
                seconds[name].append(server.ready_s)
    rows = []
    for name, values in seconds.items():
        spread = Spread.of(values)
        rows.append([name, spread.text(2), ", ".join(f"{v:.2f}" for v in values)])
    return table(["tree", "spawn to ready s", "each start"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("before", type=Path, help="a vitserve checkout with its .venv")
    parser.add_argument("after", type=Path, help="another one")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated hey -c values")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="each hey run")
    parser.add_argument("--starts", type=int, default=0, help="starts of each tree, timed")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    started = ""
    if args.starts:
        with tempfile.TemporaryDirectory() as scratch:
            started = starts(trees, args.starts, Path(scratch))
    results = load(trees, concurrencies, args.rounds, args.seconds) if concurrencies else {}
    print(f"before: {trees['before']}\nafter:  {trees['after']}\n")
    if started:
        print(started + "\n")
    if results:
        print(summary(results))
    return 0


def load(
    trees: dict[str, Path], concurrencies: list[int], rounds: int, seconds: float
) -> dict[tuple[int, str], list[hey.HeyResult]]:
    """Both services up at once; hey at each concurrency, ``rounds`` times, alternated."""
    results: dict[tuple[int, str], list[hey.HeyResult]] = {}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        body = Path(scratch) / "body-1.json"
        body.write_bytes(predict_body(b64_pngs(1)[0]))
        servers = serve_trees(stack, trees, Path(scratch), service_env)
        for concurrency in concurrencies:
            for round_number in range(rounds):
                for name in alternated(list(servers), round_number):
                    result = hey.run_for(servers[name].url + "/predict", body, concurrency, seconds)
                    results.setdefault((concurrency, name), []).append(result)
    return results


if __name__ == "__main__":
    sys.exit(main())
