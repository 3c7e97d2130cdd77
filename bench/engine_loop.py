"""What the engine's event loop spends per request, two checkouts side by side:
``python -m bench.engine_loop BEFORE AFTER``.

Both trees' services run at once (``bench.ab``'s way: each from its own tree and venv, with their
defaults); ``hey`` loads one at a time, alternated, BEFORE first in even rounds. For each run it reads
the CPU time of the engine's event-loop thread (``/proc/PID/task/PID/stat``) before and after, and
divides it by the requests answered 200: the engine loop's milliseconds per request, as BENCHMARKS.md
measures it at c=256.

    python -m bench.engine_loop ../before . [--model shipped|free] [--concurrency 256]
        [--rounds 3] [--seconds 8]

``--model free`` serves, in both trees, a model of the shipped one's interface (its metadata, labels,
config and input; logits ``[N, 10]``) whose graph is one small MatMul: the model then costs almost
nothing, and what is left is the service's own work per request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import hey
from bench.ab import serve_trees
from bench.cuda.load import engine_pid
from bench.machine import CLOCK_TICKS, thread_ticks
from bench.payloads import b64_pngs, predict_body
from bench.server_process import service_env
from bench.stats import Spread, alternated, table
from service.contract.model_repository import METADATA_KEY
from tests.support import REPO

SHIPPED = "fashion-mnist-vit"


def free_repository(directory: Path, source: Path = REPO / "models" / SHIPPED) -> Path:
    """A model repository holding one model named as the shipped one, of its interface, whose
    classifier is ``Flatten -> MatMul``: its input, metadata, labels and config, almost no work."""
    shipped = onnx.load(str(source / "1" / "model.onnx"), load_external_data=False)
    metadata = {prop.key: prop.value for prop in shipped.metadata_props}
    graph_input = shipped.graph.input[0]
    dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim[1:]]
    labels = json.loads(metadata[METADATA_KEY])["labels"]
    weights = np.random.default_rng(0).standard_normal((int(np.prod(dims)), len(labels)))
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", [graph_input.name], ["flat"]),
            helper.make_node("MatMul", ["flat", "weights"], [shipped.graph.output[0].name]),
        ],
        "near-free",
        [helper.make_tensor_value_info(graph_input.name, TensorProto.FLOAT, ["batch", *dims])],
        [
            helper.make_tensor_value_info(
                shipped.graph.output[0].name, TensorProto.FLOAT, ["batch", len(labels)]
            )
        ],
        [numpy_helper.from_array(weights.astype(np.float32), "weights")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {METADATA_KEY: metadata[METADATA_KEY]})
    version = directory / SHIPPED / "1"
    version.mkdir(parents=True)
    onnx.save(model, str(version / "model.onnx"))
    shutil.copy(source / "1" / "labels.txt", version / "labels.txt")
    shutil.copy(source / "config.pbtxt", directory / SHIPPED / "config.pbtxt")
    return directory


def measure(
    trees: dict[str, Path], repository: Path | None, concurrency: int, rounds: int, seconds: float
) -> dict[str, list[tuple[float, hey.HeyResult]]]:
    """Per tree, each run's (engine-loop ms per request answered, hey's result)."""
    results: dict[str, list[tuple[float, hey.HeyResult]]] = {name: [] for name in trees}
    settings = {} if repository is None else {"model_repository": repository}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        body = Path(scratch) / "body-1.json"
        body.write_bytes(predict_body(b64_pngs(1)[0]))
        servers = serve_trees(
            stack, trees, Path(scratch), lambda port: service_env(port, **settings)
        )
        engines = {name: engine_pid(server.process.pid) for name, server in servers.items()}
        for server in servers.values():  # warm up
            warm = hey.command(server.url + "/predict", body, concurrency=8, requests=300)
            hey.run(warm, 120)
        for round_number in range(rounds):
            for name in alternated(list(servers), round_number):
                engine = engines[name]
                assert engine is not None, f"no engine process under {name}'s service"
                before = thread_ticks(engine)[engine]
                result = hey.run_for(servers[name].url + "/predict", body, concurrency, seconds)
                spent_s = (thread_ticks(engine)[engine] - before) / CLOCK_TICKS
                results[name].append((spent_s * 1000 / max(result.ok, 1), result))
    return results


def summary(results: dict[str, list[tuple[float, hey.HeyResult]]]) -> str:
    rows = []
    for name, runs in results.items():
        loop = Spread.of(ms for ms, _ in runs)
        rps = Spread.of(r.ok_rps for _, r in runs)
        rows.append(
            [
                name,
                loop.text(3) if loop else "-",
                rps.text() if rps else "-",
                ", ".join(f"{ms:.3f}" for ms, _ in runs),
                str(sum(r.not_ok + r.error_count for _, r in runs)),
            ]
        )
    return table(
        ["tree", "engine loop ms/request", "req/s", "each run's ms/request", "not 200"], rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_loop", description=__doc__)
    parser.add_argument("before", type=Path, help="a vitserve checkout with its .venv")
    parser.add_argument("after", type=Path, help="another one")
    parser.add_argument("--model", choices=("shipped", "free"), default="shipped")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="each hey run")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory() as scratch:
        repository = free_repository(Path(scratch)) if args.model == "free" else None
        results = measure(trees, repository, args.concurrency, args.rounds, args.seconds)
    print(f"before: {trees['before']}\nafter:  {trees['after']}")
    print(f"model: {args.model}; hey -c {args.concurrency}, {args.seconds:g} s a run\n")
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
