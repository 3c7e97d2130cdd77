"""bench/graphs.py's logic, not its timings: the graphs alternated call by call, medians and ratios,
the table, and one tiny model measured end to end (three graphs, logits held to PyTorch)."""

from __future__ import annotations

import torch

from bench import graphs
from bench.graphs import GRAPHS, INT8, LEGACY, VITSERVE, Measured, Sample
from export.model import VisionTransformer
from tests.support import TINY


def test_graphs_alternate_call_by_call_and_reverse_every_other_round():
    order = []
    calls = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    clock = iter(range(100))

    def fake_clock(call):
        call()
        tick = next(clock)
        return Sample(tick, tick / 2)

    samples = graphs.interleave(calls, rounds=2, per_round=2, clock=fake_clock)
    assert order[:3] == ["a", "b", "c"]  # the untimed warm-up call of each
    assert order[3:] == ["a", "b", "c"] * 2 + ["c", "b", "a"] * 2
    assert {name: len(s) for name, s in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert [s.wall_s for s in samples["c"]] == [2, 5, 6, 9]


def measured(graph: str, wall: list[float], cpu: list[float], batch: int = 8) -> Measured:
    samples = [Sample(w, c) for w, c in zip(wall, cpu, strict=True)]
    return Measured("tiny", graph, {batch: samples}, 1e-6, {"BiasGelu": 12})


def test_images_per_second_is_the_batch_over_the_median_call():
    result = measured(VITSERVE, [0.5, 0.4, 10.0], [0.4, 0.3, 0.35])
    assert result.images_per_s(8) == 8 / 0.5
    assert result.images_per_s(8, "cpu_s") == 8 / 0.35
    assert result.images_per_s(1) is None


def test_the_table_gives_each_graph_against_the_legacy_export_of_its_size():
    ours = measured(VITSERVE, [0.4, 0.4], [0.3, 0.3])
    legacy = measured(LEGACY, [0.5, 0.5], [0.33, 0.33])
    text = graphs.markdown([ours, legacy], [8])
    header, _, first, second = text.splitlines()
    assert "b8 img/s" in header and "b8 x legacy" in header and "fused" in header
    assert first.startswith("| ViT-Ti/16 | vitserve | 20.0 | 1.25 (CPU 1.10) | 1e-06 |")
    assert "BiasGelu x12" in first
    assert second.startswith("| ViT-Ti/16 | torch legacy (opset 17) | 16.0 | 1.00 (CPU 1.00) |")


def test_a_tiny_model_is_measured_end_to_end():
    # The suite's tiny model, shaped like the models the bench measures: RGB, token pooling.
    config = TINY.replace(
        image_height=32, image_width=32, in_channels=3, patch_size=8, pooling="token"
    )
    torch.manual_seed(0)
    model = VisionTransformer(config).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    results = graphs.measure_size("tiny", [1, 3], rounds=1, per_round=1, model=model)
    assert [r.graph for r in results] == list(GRAPHS)
    for r in results:
        assert sorted(r.samples) == [1, 3] and all(len(s) == 1 for s in r.samples.values())
        assert r.images_per_s(3) > 0
    by_graph = {r.graph: r for r in results}
    assert by_graph[VITSERVE].logits_max_abs_diff < 1e-4
    assert by_graph[LEGACY].logits_max_abs_diff < 1e-4
    assert 0 < by_graph[INT8].logits_max_abs_diff < float("inf")  # int8: near, never equal
    assert by_graph[VITSERVE].fusions["BiasGelu"] == config.depth
    # every product by a weight quantized, q, k and v's thirds of the packed weight among them
    fused = by_graph[INT8].fusions
    products = fused.get("DynamicQuantizeMatMul", 0) + fused.get("MatMulIntegerToFloat", 0)
    assert products == 6 * config.depth + 1
