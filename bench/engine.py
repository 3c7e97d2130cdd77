"""onnxruntime vs PyTorch eager on the same weights and the same thread count, and the classifier graph
vs the attention graph.

``python -m bench.engine --json OUT [--quick] [--threads N]``

- The shipped model: onnxruntime runs ``model.onnx`` with the service's own session options
  (``service.runtime.open_session``); PyTorch runs ``export.model.VisionTransformer`` built from the
  file's ``model_config`` with the file's initializers copied in (bench/weights.py, checked against
  onnxruntime before anything is timed).
- A larger model (DeiT-Tiny sizes on 32x32 RGB, patch 4: 5.4M parameters, about 15x the shipped model's
  compute per image), randomly initialised, exported on the fly with ``export.onnx.classifier_graph``
  (what ``build_graphs`` writes as ``model.onnx``) into a temporary directory.
- ``model.onnx`` vs ``attention.onnx`` of the shipped model at batch 32 (and 1): what ``/predict``
  would pay if it ran the graph that also outputs attention maps.
- The shipped weights exported as a classifier three ways (explicit softmax at opset 18, as shipped;
  ``scaled_dot_product_attention`` at opset 18; the same at opset 23, one ``Attention`` op a layer):
  the measurement behind ``export.onnx.build_graphs``.

Every point is images/s, repeated (interleaved across engines and batch sizes), reported as the median
with min and max.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from bench.machine import busy_check
from bench.stats import rate, summarize
from bench.weights import read_metadata, torch_from_onnx
from export.config import ViTConfig
from export.model import VisionTransformer
from export.onnx import OPSET, classifier_graph, example_input, to_onnx
from service.runtime import open_session, session_options
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "fashion-mnist-vit" / "1"
# Graphs that differ by a few percent, while one repeat on the shared 2-core machine can swing 30%:
# a verdict needs many interleaved pairs, and they are cheap (about 1 s a graph at batch 32).
PAIRED_REPEATS = 15
LARGE_NAME = "vit-ti-cifar"
LARGE = ViTConfig(
    image_height=32,
    image_width=32,
    in_channels=3,
    patch_size=4,
    num_classes=10,
    dim=192,
    depth=12,
    heads=3,
    mlp_dim=768,
    pooling="token",
)


def threads_default() -> int:
    """OMP_NUM_THREADS when set (smoke runs on a shared machine), else every CPU we may use."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ort_session(path: Path, threads: int):
    return open_session(path, Settings(provider="cpu", intra_op_threads=threads))


def images_for(config: ViTConfig, batch: int) -> np.ndarray:
    rng = np.random.default_rng(batch)
    shape = (batch, config.in_channels, config.image_height, config.image_width)
    return rng.standard_normal(shape, dtype=np.float32)


def compare_engines(
    name: str,
    model: VisionTransformer,
    onnx_path: Path,
    threads: int,
    batches: list[int],
    repeats: int,
    min_time_s: float,
) -> dict:
    session = ort_session(onnx_path, threads)
    input_name = session.get_inputs()[0].name
    runners = {}
    for batch in batches:
        x = images_for(model.config, batch)
        tensor = torch.from_numpy(x)

        def run_ort(x=x):
            return session.run(None, {input_name: x})

        def run_torch(tensor=tensor):
            with torch.inference_mode():
                return model(tensor)

        runners[batch] = {"onnxruntime": run_ort, "pytorch": run_torch}
        for run in runners[batch].values():  # warm-up, and a check that both agree
            run()
        with torch.inference_mode():
            difference = float(np.abs(model(tensor).numpy() - run_ort()[0]).max())
        if difference > 1e-3 * max(1.0, float(np.abs(run_ort()[0]).max())):
            raise RuntimeError(f"{name}: engines disagree by {difference:.3g} at batch {batch}")
    samples: dict[str, dict[int, list[float]]] = {
        "onnxruntime": {b: [] for b in batches},
        "pytorch": {b: [] for b in batches},
    }
    for repeat in range(repeats):
        for batch in batches:
            engines = ["onnxruntime", "pytorch"]
            if repeat % 2:
                engines.reverse()
            for engine in engines:
                min_calls = 2 if batch >= 64 else 3
                samples[engine][batch].append(
                    rate(runners[batch][engine], batch, min_time_s, min_calls)
                )
    table = {}
    for batch in batches:
        ort_summary = summarize(samples["onnxruntime"][batch])
        torch_summary = summarize(samples["pytorch"][batch])
        table[str(batch)] = {
            "onnxruntime": ort_summary,
            "pytorch": torch_summary,
            "onnxruntime_over_pytorch": ort_summary["median"] / torch_summary["median"],
        }
        print(
            f"  {name} batch {batch:>3}: onnxruntime {ort_summary['median']:>9,.0f} img/s, "
            f"pytorch {torch_summary['median']:>9,.0f} img/s",
            flush=True,
        )
    return {
        "config": model.config.to_dict(),
        "parameters": model.num_parameters(),
        "samples": {e: {str(b): v for b, v in s.items()} for e, s in samples.items()},
        "batches": table,
    }


def interleaved(
    runs: dict[str, Callable[[], object]], batch: int, repeats: int, min_time_s: float, base: str
) -> dict:
    """Images/s of each run, one repeat of every run after another (order reversed every other
    repeat), and each run's ratio to ``base`` within the same repeat: a paired comparison, which
    a noisy shared machine needs more than large samples."""
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            samples[name].append(rate(runs[name], batch, min_time_s, 3))
    return {
        name: {
            "images_per_s": summarize(values),
            f"over_{base}": summarize([v / b for v, b in zip(values, samples[base], strict=True)]),
            "samples": values,
        }
        for name, values in samples.items()
    }


def classifier_vs_attention(
    threads: int, batches: list[int], repeats: int, min_time_s: float
) -> dict:
    sessions = {
        "model.onnx": ort_session(SHIPPED / "model.onnx", threads),
        "attention.onnx": ort_session(SHIPPED / "attention.onnx", threads),
    }
    config = ViTConfig.from_dict(
        read_metadata(onnx.load(str(SHIPPED / "model.onnx")))["model_config"]
    )
    result = {}
    for batch in batches:
        x = images_for(config, batch)
        runs = {
            graph: (lambda s=session, x=x: s.run(None, {"images": x}))
            for graph, session in sessions.items()
        }
        measured = interleaved(runs, batch, repeats, min_time_s, base="attention.onnx")
        result[str(batch)] = {
            "model.onnx": measured["model.onnx"]["images_per_s"],
            "attention.onnx": measured["attention.onnx"]["images_per_s"],
            "classifier_over_attention": measured["model.onnx"]["over_attention.onnx"],
            "samples": {graph: measured[graph]["samples"] for graph in runs},
        }
        print(
            f"  classifier vs attention graph, batch {batch}: "
            f"{result[str(batch)]['model.onnx']['median']:,.0f} vs "
            f"{result[str(batch)]['attention.onnx']['median']:,.0f} img/s",
            flush=True,
        )
    return result


SHIPPED_EXPORT = "explicit softmax, opset 18 (shipped model.onnx)"
CLASSIFIER_EXPORTS = {
    # name: (fused attention in PyTorch, opset)
    SHIPPED_EXPORT: (False, OPSET),
    "scaled_dot_product_attention, opset 18": (True, OPSET),
    "scaled_dot_product_attention, opset 23 (ONNX Attention op)": (True, 23),
}


def classifier_exports(
    model: VisionTransformer, threads: int, batches: list[int], repeats: int, min_time_s: float
) -> dict:
    """The shipped weights exported as a classifier three ways: why export.onnx.build_graphs exports
    the explicit softmax path (it re-exports the shipped one too, to compare like with like)."""
    c = model.config
    example = example_input(model)
    options = session_options(Settings(provider="cpu", intra_op_threads=threads))
    sessions, nodes = {}, {}
    for name, (fused, opset) in CLASSIFIER_EXPORTS.items():
        model.set_fused_attention(fused)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = to_onnx(model.eval(), example, ["logits"], opset=opset)
        finally:
            model.set_fused_attention(True)
        nodes[name] = len(graph.graph.node)
        sessions[name] = ort.InferenceSession(
            graph.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    result: dict = {"shipped": SHIPPED_EXPORT, "nodes": nodes, "batches": {}}
    for batch in batches:
        x = images_for(c, batch)
        outputs = {name: s.run(None, {"images": x})[0] for name, s in sessions.items()}
        differences = {
            name: float(np.abs(out - outputs[SHIPPED_EXPORT]).max())
            for name, out in outputs.items()
        }
        if max(differences.values()) > 1e-4:
            raise RuntimeError(f"classifier exports disagree at batch {batch}: {differences}")
        runs = {
            name: (lambda s=session, x=x: s.run(None, {"images": x}))
            for name, session in sessions.items()
        }
        measured = interleaved(runs, batch, repeats, min_time_s, base=SHIPPED_EXPORT)
        result["batches"][str(batch)] = {
            name: {
                "images_per_s": values["images_per_s"],
                "over_shipped": values[f"over_{SHIPPED_EXPORT}"],
                "wins_over_shipped": sum(
                    v > b
                    for v, b in zip(
                        values["samples"], measured[SHIPPED_EXPORT]["samples"], strict=True
                    )
                ),
                "repeats": len(values["samples"]),
                "max_abs_diff_vs_shipped": differences[name],
            }
            for name, values in measured.items()
        }
        for name, values in result["batches"][str(batch)].items():
            print(
                f"  classifier export batch {batch:>3}: {name}: "
                f"{values['images_per_s']['median']:,.0f} img/s, "
                f"x{values['over_shipped']['median']:.3f} of shipped",
                flush=True,
            )
    return result


def export_large(directory: Path) -> tuple[VisionTransformer, Path, float]:
    """The larger model, randomly initialised (head included, so the logits are not all zero)."""
    torch.manual_seed(0)
    model = VisionTransformer(LARGE).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = classifier_graph(model)
    path = directory / "model.onnx"
    onnx.save_model(proto, path)
    return model, path, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="smoke run: few, short repeats")
    parser.add_argument("--threads", type=int, default=threads_default())
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--min-time", type=float, default=None, help="seconds per timed point")
    parser.add_argument("--skip-large", action="store_true", help="only the shipped model")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    min_time = args.min_time or (0.05 if args.quick else 0.5)
    batches = [1, 32] if args.quick else [1, 8, 32, 128]
    threads = args.threads
    torch.set_num_threads(threads)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    started = time.perf_counter()
    results: dict = {
        "threads": threads,
        "repeats": repeats,
        "min_time_s": min_time,
        "batches": batches,
        "models": {},
    }
    print(f"engine: {threads} thread(s), {repeats} repeats, >= {min_time} s per point", flush=True)
    results["busy_checks"] = [busy_check().to_dict()]
    shipped, _ = torch_from_onnx(SHIPPED / "model.onnx")
    results["models"]["fashion-mnist-vit (shipped)"] = compare_engines(
        "shipped", shipped, SHIPPED / "model.onnx", threads, batches, repeats, min_time
    )
    pair_repeats = max(repeats, PAIRED_REPEATS) if not args.quick else repeats
    results["classifier_vs_attention"] = classifier_vs_attention(
        threads, [1, 32], pair_repeats, min_time
    )
    results["classifier_exports"] = classifier_exports(
        shipped, threads, [1, 32] if args.quick else [1, 32, 64], pair_repeats, min_time
    )
    if not args.skip_large:
        with tempfile.TemporaryDirectory(prefix="vitserve-bench-") as tmp:
            large, path, export_s = export_large(Path(tmp))
            print(f"  exported {LARGE_NAME} in {export_s:.1f} s", flush=True)
            entry = compare_engines(LARGE_NAME, large, path, threads, batches, repeats, min_time)
            entry["export_seconds"] = export_s
            results["models"][f"{LARGE_NAME} (larger)"] = entry
    results["busy_checks"].append(busy_check().to_dict())
    results["busy"] = any(check["busy"] for check in results["busy_checks"])
    results["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"engine: done in {results['seconds']:.0f} s -> {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
