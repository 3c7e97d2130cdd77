"""Where a lone request's time goes: ``python -m bench.lone_call [--rounds 4] [--seconds 8]``.

A lone client (c=1) is to be answered within 5% of the plain server's p50
(docs/decisions.md#performance-targets). This
runs side by side the plain server and vitserve in one process (``VITSERVE_WORKERS=0``), with one
front end (``1``) and with its default (one per core); one client sends single base64 PNGs to each
in turn, half a second each (bench/one_client.py, every request timed to the microsecond), and reads
the model's own statistics (``/v2/models/{name}/stats``, the engine's counters, as Triton keeps
them) before and after each round. Per request, over the round:

- ``success``: from the engine taking the call to its answer;
- ``queue``: in the batcher's queue; ``input``: stacking the rows; ``infer``: the model's ``run``.

So the split's cost shows apart from the model's: what the front end and the process hop add is the
p50 less the engine's ``success``, and a model that runs slower in the engine process than in the
front end's shows in ``infer``. Prints the medians over the rounds (with their spread) as Markdown.
BENCHMARKS.md quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import hey, one_client
from bench.contenders import Server, cores, servers
from bench.payloads import b64_pngs, predict_body
from bench.server_process import REPO, SERVICE, running
from bench.stats import Spread, alternated, table

PORTS = range(18180, 18200)
MODEL_DIR = Path("models/fashion-mnist-vit/1")
# the engine's cumulative durations, per request: (shown as, inference_stats key)
PARTS = (("success", "success"), ("queue", "queue"), ("input", "compute_input"),
         ("infer", "compute_infer"))  # fmt: skip


def contenders(workers: int) -> list[Server]:
    """The plain server, then vitserve in one process, with one front end and with ``workers``."""
    plain = next(s for s in servers(MODEL_DIR, {}, workers) if s.key == "plain")
    vitserve = [
        Server(f"w{count}", f"vitserve, VITSERVE_WORKERS={count}", SERVICE, {"workers": str(count)})
        for count in dict.fromkeys((0, 1, workers))
    ]
    return [plain, *vitserve]


def per_request_us(before: dict, after: dict) -> dict[str, float] | None:
    """Each part's microseconds per request between two answers of the stats route (one model's
    ``inference_stats``); None when no request succeeded in between."""
    count = after["success"]["count"] - before["success"]["count"]
    if count <= 0:
        return None
    return {shown: (after[key]["ns"] - before[key]["ns"]) / count / 1000 for shown, key in PARTS}


def model_stats(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=10) as answer:
        return json.load(answer)["model_stats"][0]["inference_stats"]


def summary(runs: dict[str, list[tuple[hey.HeyResult, dict[str, float] | None]]]) -> str:
    rows = []
    for key, results in runs.items():
        parts = [Spread.of(p[shown] if p else None for _, p in results) for shown, _ in PARTS]
        rps, p50 = Spread.of(r.ok_rps for r, _ in results), Spread.of(r.ms(50) for r, _ in results)
        rows.append(
            [
                key,
                rps.text() if rps else "-",
                p50.text(2) if p50 else "-",
                *(part.text() if part else "-" for part in parts),
                str(sum(r.not_ok + r.error_count for r, _ in results)),
            ]
        )
    headers = ["server", "req/s", "p50 ms", *(f"{shown} µs" for shown, _ in PARTS), "not 200"]
    return table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone_call", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="each server's share of a round")
    parser.add_argument("--workers", type=int, default=cores(), help="the default's front ends")
    args = parser.parse_args(argv)
    plan = contenders(args.workers)
    model = MODEL_DIR.parent.name
    runs: dict[str, list[tuple[hey.HeyResult, dict[str, float] | None]]] = {}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        body = Path(scratch) / "body-1.json"
        body.write_bytes(predict_body(b64_pngs(1)[0]))
        live = {
            server.key: stack.enter_context(
                running(
                    server.argv,
                    lambda port, server=server: server.env(port, REPO / MODEL_DIR),
                    Path(scratch) / f"{server.key}.log",
                    ports=PORTS,
                    start=index * 4,
                    name=server.label,
                )
            )
            for index, server in enumerate(plan)
        }
        payload = body.read_bytes()
        for round_number in range(args.rounds):
            order = alternated(list(live), round_number)
            targets = [(live[key].url + "/predict", payload) for key in order]
            one_client.alternate(targets, 2 * len(order))  # warm-up
            ours = [key for key in order if key != "plain"]
            before = {key: model_stats(live[key].url, model) for key in ours}
            results = one_client.alternate(targets, args.seconds * len(order))
            for key, result in zip(order, results, strict=True):
                parts = (
                    per_request_us(before[key], model_stats(live[key].url, model))
                    if key in before
                    else None
                )
                runs.setdefault(key, []).append((result, parts))
    print("\n".join(f"{s.key}: {s.shown()}" for s in plan) + "\n")
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
