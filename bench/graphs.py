"""The model alone in onnxruntime: vitserve's exported graph against torch's legacy exporter, and
vitserve's graph quantized to int8.

    python -m bench.graphs [--sizes tiny,small] [--base] [--batches 1,8] [--rounds 6] [--calls 4]

For ViT-Ti/16 and ViT-S/16 (``--base`` adds ViT-B/16, slow on two cores) with seeded random weights
(bench/heavy_models.py's configs; the head and the qkv bias drawn too, so that the logits compared
are not all zero), three graphs of the same model:

- ``vitserve``: ``export.onnx_graphs.classifier_graph``, what ``python -m export.onnx`` ships;
- ``torch legacy``: ``torch.onnx.export(dynamo=False)`` at opset 17 of the same model as timm and
  Hugging Face run a ViT (fused attention, every token through every block; vitserve's forward
  takes the last block's class token only, ``VisionTransformer.read_rows``), with a dynamic batch
  axis. Both exporters trace the same blocks
  (``torch.onnx.is_in_onnx_export()`` is true in both: GELU and q, k, v written as onnxruntime
  fuses them, docs/decisions.md#onnx-graph-for-onnxruntime), so the two rows compare exporters,
  as the issue did on a Hugging Face DeiT (separate q, k, v; a GELU the legacy exporter fuses).
  One difference is the export's own: its explicit attention takes the queries scaled by their
  weights, where the legacy exporter writes scaled_dot_product_attention's scale as two Mul;
- ``int8 dynamic``: vitserve's graph through ``export.quantize.quantize_graph(..., "dynamic")``
  (onnxruntime's ``quantize_dynamic``, int8 weights per tensor in 7 bits: ``WEIGHT_RANGE``).

Each runs in its own onnxruntime session, ``ORT_ENABLE_ALL``, one thread (intra_op and inter_op 1),
on seeded images, no server and no preprocessing. Per batch size, ``--rounds`` rounds of ``--calls``
calls per graph, the graphs alternated call by call and their order reversed every other round, so
that the machine's drift and the other work on it fall on every graph alike. A graph's images/s is
the batch over its median call's wall time; the ratio to the legacy graph is given from wall time
and from the CPU time of the calling thread (which a busy machine inflates less). The logits' largest
absolute difference from PyTorch's forward pass is over every batch size's images; the fused nodes
are what onnxruntime's optimizer makes of each graph (``export.onnx_graphs.onnxruntime_fusions``).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch

from bench.heavy_models import config_for
from bench.stats import alternated, fmt, ratio, table
from export.model import VisionTransformer
from export.onnx_graphs import classifier_graph, fusions_text, onnxruntime_fusions
from export.quantize import quantize_graph

SIZES = ("tiny", "small")
LABELS = {"tiny": "ViT-Ti/16", "small": "ViT-S/16", "base": "ViT-B/16"}
VITSERVE, LEGACY, INT8 = "vitserve", "torch legacy (opset 17)", "int8 dynamic"
GRAPHS = (VITSERVE, LEGACY, INT8)
LEGACY_OPSET = 17
BATCHES = (1, 8)


@dataclass
class Sample:
    """One call: its wall time and the CPU time of the thread that made it, in seconds."""

    wall_s: float
    cpu_s: float


@dataclass
class Measured:
    """One graph of one model size: its calls per batch size, its logits' error, its fusions."""

    size: str
    graph: str
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    logits_max_abs_diff: float | None = None
    fusions: dict[str, int] = field(default_factory=dict)

    def median_s(self, batch: int, clock: str = "wall_s") -> float | None:
        calls = self.samples.get(batch)
        return statistics.median(getattr(s, clock) for s in calls) if calls else None

    def images_per_s(self, batch: int, clock: str = "wall_s") -> float | None:
        seconds = self.median_s(batch, clock)
        return batch / seconds if seconds else None


def random_weight_model(size: str, seed: int = 0, image: int = 224) -> VisionTransformer:
    """bench/heavy_models.py's model of ``size`` (its own seeded initialisation), with the head
    and the qkv bias drawn as well (the initialisation zeroes them)."""
    torch.manual_seed(seed)
    model = VisionTransformer(config_for(size, image)).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight, std=0.02)
        torch.nn.init.normal_(model.head.bias, std=0.02)
        for block in model.blocks:
            if block.attention.qkv.bias is not None:
                torch.nn.init.normal_(block.attention.qkv.bias, std=0.02)
    return model


class EveryToken(torch.nn.Module):
    """``model``'s logits with every token through every block, as timm's and Hugging Face's ViTs
    compute them (their last block computes every token's output; the head reads one)."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features, _ = self.model.forward_features(images)
        return self.model.logits(features)


def legacy_graph(model: VisionTransformer, opset: int = LEGACY_OPSET) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=False)`` of ``model`` as timm and Hugging Face run a ViT (every
    token through every block), batch axis dynamic."""
    c = model.config
    example = torch.zeros(2, c.in_channels, c.image_height, c.image_width)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(
            EveryToken(model.eval()),
            (example,),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=["images"],
            output_names=["logits"],
            dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
        )
    return onnx.load_from_string(buffer.getvalue())


def build(model: VisionTransformer) -> dict[str, onnx.ModelProto]:
    """The three graphs of ``model``, by name (:data:`GRAPHS`)."""
    ours = classifier_graph(model)
    return {VITSERVE: ours, LEGACY: legacy_graph(model), INT8: quantize_graph(ours, "dynamic")}


def session(graph: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(
        graph.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def timed(call: Callable[[], object]) -> Sample:
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return Sample(time.perf_counter() - wall, time.thread_time() - cpu)


def interleave(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    per_round: int,
    clock: Callable[[Callable[[], object]], Sample] = timed,
) -> dict[str, list[Sample]]:
    """Each of ``calls`` ``rounds * per_round`` times, alternated call by call, the order reversed
    every other round (bench/stats.py's ``alternated``); after one untimed call of each."""
    for call in calls.values():
        call()
    samples: dict[str, list[Sample]] = {name: [] for name in calls}
    for repeat in range(rounds):
        order = alternated(list(calls), repeat)
        for _ in range(per_round):
            for name in order:
                samples[name].append(clock(calls[name]))
    return samples


def measure_size(
    size: str,
    batches: Sequence[int],
    rounds: int,
    per_round: int,
    seed: int = 0,
    model: VisionTransformer | None = None,
) -> list[Measured]:
    """Build, check and time the three graphs of one model size."""
    model = model or random_weight_model(size, seed)
    graphs = build(model)
    sessions = {name: session(graph) for name, graph in graphs.items()}
    results = {
        name: Measured(size, name, fusions=onnxruntime_fusions(graph))
        for name, graph in graphs.items()
    }
    c = model.config
    generator = torch.Generator().manual_seed(seed)
    for batch in batches:
        images = torch.randn(
            batch, c.in_channels, c.image_height, c.image_width, generator=generator
        )
        with torch.inference_mode():
            expected = model(images).numpy()
        feed = {"images": images.numpy()}
        for name, ran in sessions.items():
            (logits,) = ran.run(["logits"], feed)
            error = float(np.abs(logits - expected).max())
            previous = results[name].logits_max_abs_diff
            results[name].logits_max_abs_diff = max(error, previous or 0.0)
        calls = {
            name: (lambda s=ran, f=feed: s.run(["logits"], f)) for name, ran in sessions.items()
        }
        for name, samples in interleave(calls, rounds, per_round).items():
            results[name].samples[batch] = samples
    return [results[name] for name in GRAPHS]


def versus(result: Measured, reference: Measured | None, batch: int) -> str:
    """``1.04 (CPU 1.03)``: ``result``'s speed over ``reference``'s, from wall and CPU time."""
    if reference is None:
        return "-"
    wall = ratio(result.images_per_s(batch), reference.images_per_s(batch))
    cpu = ratio(result.images_per_s(batch, "cpu_s"), reference.images_per_s(batch, "cpu_s"))
    return f"{fmt(wall, 2)} (CPU {fmt(cpu, 2)})"


def markdown(results: list[Measured], batches: Sequence[int]) -> str:
    """One row per model size and graph: images/s per batch size, the speed relative to the legacy
    export of the same size, the logits' error, onnxruntime's fused nodes."""
    legacy = {r.size: r for r in results if r.graph == LEGACY}
    headers = ["model", "graph"]
    headers += [f"b{b} img/s" for b in batches]
    headers += [f"b{b} x legacy" for b in batches]
    headers += ["logits max abs diff vs PyTorch", "onnxruntime fused nodes"]
    rows = []
    for r in results:
        diff = "-" if r.logits_max_abs_diff is None else f"{r.logits_max_abs_diff:.2g}"
        rows.append(
            [LABELS.get(r.size, r.size), r.graph]
            + [fmt(r.images_per_s(b), 1) for b in batches]
            + [versus(r, legacy.get(r.size), b) for b in batches]
            + [diff, fusions_text(r.fusions)]
        )
    return table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.graphs", description=__doc__)
    parser.add_argument("--sizes", default=",".join(SIZES), help="of tiny,small,base")
    parser.add_argument("--base", action="store_true", help="add ViT-B/16 (slow on two cores)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--rounds", type=int, default=6, help="rounds per batch size")
    parser.add_argument("--calls", type=int, default=4, help="calls of each graph per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.base and "base" not in sizes:
        sizes.append("base")
    unknown = [s for s in sizes if s not in LABELS]
    if unknown:
        parser.error(f"--sizes {','.join(unknown)}: expected some of tiny,small,base")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches {args.batches!r}: expected batch sizes, e.g. 1,8")
    if args.rounds < 1 or args.calls < 1 or not batches or min(batches) < 1:
        parser.error("--rounds, --calls and every batch size must be 1 or more")
    results = []
    for size in sizes:
        print(f"{LABELS[size]}: exporting and timing ...", file=sys.stderr, flush=True)
        results += measure_size(size, batches, args.rounds, args.calls, args.seed)
    shown = " ".join(["python -m bench.graphs", *(argv if argv is not None else sys.argv[1:])])
    print(f"`{shown}` (onnxruntime {ort.__version__}, torch {torch.__version__}, one thread)\n")
    print(markdown(results, batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
