"""The comparison's plan, what it reads from /metrics, and its targets. No server starts here."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from bench import compare, profile, swap
from bench.comparison import Comparison, Point, Start
from bench.stats import Spread

MODEL_DIR = Path("/repo/models/fashion-mnist-vit/1")


def test_every_bench_uses_its_own_ports():
    ranges = [compare.PORTS, profile.PORTS, swap.PORTS]
    assert all(r.start >= 18100 and r.stop <= 18200 for r in ranges)
    assert len({p for r in ranges for p in r}) == sum(len(r) for r in ranges)  # no overlap


def test_start_up_phases_from_the_service_gauge():
    registry = CollectorRegistry()
    gauge = Gauge(
        "vitserve_model_load_seconds",
        "Seconds each start-up phase of a model version took.",
        ["model", "version", "phase"],
        registry=registry,
    )
    gauge.labels(model="fashion-mnist-vit", version="1", phase="load").set(0.31)
    gauge.labels(model="fashion-mnist-vit", version="1", phase="warmup").set(0.87)
    text = generate_latest(registry).decode()
    assert compare.load_breakdown(text) == {"load": 0.31, "warmup": 0.87}
    assert compare.load_breakdown(None) == {}


def test_batch_counters_read_the_classifier_histogram():
    registry = CollectorRegistry()
    sizes = Histogram(
        "vitserve_batch_size", "Images per run.", ["graph"], buckets=(1, 8, 32), registry=registry
    )
    for size in (32, 16, 8):
        sizes.labels(graph="classifier").observe(size)
    sizes.labels(graph="attention").observe(2)
    text = generate_latest(registry).decode()
    assert compare.batch_counters(text) == (56.0, 3.0)
    assert compare.batch_counters(None) == (0.0, 0.0)


def point(server, c, rps, p99, images=1, busy=False, repeat=0):
    return Point(server, images, c, repeat, rps, p99 / 2, p99, 0, 0, busy)


def comparison(ours=1500.0, plain=1000.0, our_p99=50.0, plain_p99=90.0, batch32=100.0, **kw):
    result = Comparison({"vitserve": "v", "plain": "p"}, 10.0, 3, "test images", 2)
    for c in (64, 256):
        for repeat, jitter in enumerate((0.9, 1.0, 1.1)):
            result.points += [
                point(
                    "vitserve", c, ours * jitter, our_p99, repeat=repeat, busy=bool(kw.get("busy"))
                ),
                point("plain", c, plain * jitter, plain_p99, repeat=repeat),
                point("int8", c, kw.get("int8", 2400.0) * jitter, our_p99, repeat=repeat),
                point(
                    "vitserve",
                    c,
                    batch32 * jitter * (1 if c == 64 else 0.8),
                    500.0,
                    images=32,
                    repeat=repeat,
                ),
            ]
    result.ceiling = {8: [1500.0, 1600.0], 32: kw.get("ceiling", [1600.0, 1650.0, 1700.0])}
    ready = Spread.of(kw.get("ready", [1.2, 1.4, 1.3]))
    result.starts["vitserve"] = Start(
        ready, Spread.of([0.3]), Spread.of([0.9]), 150_000, kw.get("peak", 200 * 1024)
    )
    return result


def verdicts(result):
    return [target.passed for target in result.targets()]


def test_targets_pass():
    result = comparison()
    assert verdicts(result) == [True] * 9
    first = result.targets()[0]
    assert first.measured == "1.500x (1,500 vs 1,000)" and first.verdict == "PASS"
    assert "at batch 32" in result.targets()[4].measured  # the best batch size of the ceiling
    assert "3,200 at c=64" in result.targets()[5].measured  # 32 x the 32-image request rate
    assert result.targets()[6].measured == "1.600x (2,400 vs 1,500)"  # int8 against fp32


def test_each_target_fails():
    result = comparison(
        ours=1400.0,
        our_p99=100.0,
        batch32=40.0,
        int8=1500.0,
        ceiling=[2000.0],
        ready=[1.5, 2.1],
        peak=400 * 1024,
    )
    assert verdicts(result) == [False] * 9


def test_a_busy_run_marks_the_targets_it_feeds():
    targets = comparison(busy=True).targets()
    assert targets[0].busy and "not a result" in targets[0].verdict
    assert not targets[-1].busy


def test_nothing_measured():
    result = Comparison({"vitserve": "v"}, 10.0, 3, "x")
    assert set(verdicts(result)) == {None}
    assert "NOT MEASURED" in result.markdown()


def test_markdown_shows_the_ratio_the_32_image_table_and_the_start_up():
    text = comparison().markdown()
    assert "| 64 | 1,500 (1,350-1,650) (50.0) | 1,000 (900-1,100) (90.0) | 1.50x |" in text
    assert "| 64 | 3,200 (2,880-3,520) (500.0) | 1,000 (900-1,100) | 3.20x |" in text
    assert "| vitserve | 1.30 (1.20-1.40) | 0.30 + 0.90 | 146 | 200 |" in text
    assert "| 32 (best) | 1,650 (1,600-1,700) |" in text


def test_the_ceiling_target_says_what_a_server_with_no_model_answers():
    result = comparison()
    assert "no model" not in result.targets()[4].measured
    result.points += [point("nomodel", 64, 700.0, 90.0, repeat=r) for r in range(3)]
    assert result.targets()[4].measured.endswith(
        "; with no model at all the plain server answers 700"
    )


MOSEC_METRICS = """# HELP mosec_service_batch_size batch size.
# TYPE mosec_service_batch_size histogram
mosec_service_batch_size_sum{stage="Infer_2",connection="1"} 96.0
mosec_service_batch_size_count{stage="Infer_2",connection="1"} 3
mosec_service_batch_size_bucket{le="64.0",stage="Infer_2",connection="1"} 3
mosec_service_batch_size_bucket{le="+Inf",stage="Infer_2",connection="1"} 3
mosec_service_remaining_task 0
"""


def test_batch_counters_read_mosecs_histogram_too():
    assert compare.batch_counters(MOSEC_METRICS, "mosec_service_batch_size") == (96.0, 3.0)
    assert compare.batch_counters(MOSEC_METRICS) == (0.0, 0.0)  # not vitserve's
    found = {s.key: s.batch_histogram for s in compare.servers(MODEL_DIR, {"x": {}}, workers=2)}
    assert found["vitserve"] == found["w1"] == found["x"] == "vitserve_batch_size"
    assert found["mosec"] == "mosec_service_batch_size"
    assert found["plain"] is found["triton"] is None  # no batches, or no /metrics on its port
