"""The targets against the anchors and the anchors' table, from hand-made points. No server starts here."""

from __future__ import annotations

from bench.comparison import Comparison, Point, Start
from bench.stats import Spread
from bench.targets import anchor_targets


def point(server, c, rps, p50, p99, kind="png", repeat=0, cores=1.5, busy=False):
    return Point(server, 1, c, repeat, rps, p50, p99, 0, 0, busy, None, kind, cores)


def comparison(
    ours=1900.0, our_p99=50.0, tensor=1600.0, c1_p50=5.2, peak=500, ready=(2.1, 2.5), busy=False
):
    result = Comparison({"vitserve": "v", "mosec": "m", "triton": "t", "plain": "p"}, 10.0, 3, "x")
    for repeat, jitter in enumerate((0.9, 1.0, 1.1)):
        for c in (64, 256):
            result.points += [
                point("vitserve", c, ours * jitter, 20.0, our_p99, repeat=repeat, busy=busy),
                point("mosec", c, 1600.0 * jitter, 20.0, 60.0, repeat=repeat, cores=1.2),
            ]
        result.points += [
            point("vitserve", 64, tensor, 30.0, 80.0, "tensor", repeat),
            point("triton", 64, 1300.0, 30.0, 80.0, "tensor", repeat),
            point("vitserve", 1, 190.0, c1_p50, 9.0, repeat=repeat),
            point("plain", 1, 190.0, 5.0, 9.0, repeat=repeat),
        ]
    result.starts["vitserve"] = Start(Spread.of(ready), None, None, 300_000, peak * 1024)
    return result


def test_issue_23_targets_pass():
    targets = anchor_targets(comparison())
    assert [t.passed for t in targets] == [True] * 8
    assert targets[0].name == "c=64, one base64 PNG per request: >= 1.15x mosec's req/s"
    assert targets[0].measured == "1.188x (1,900 vs 1,600)"
    assert targets[1].measured == "50.0 vs 60.0 ms"
    assert targets[4].measured == "1.231x (1,600 vs 1,300)"  # the FP32 tensor against Triton
    assert targets[5].measured == "5.20 vs 5.00 ms (1.040x)"  # c=1 p50 against the plain server
    assert targets[6].measured == "500 MiB"
    assert targets[7].measured == "2.50 s (median 2.30)"


def test_issue_23_targets_fail():
    result = comparison(1800.0, 70.0, 1500.0, 5.3, 700, (2.0, 3.1))
    assert [t.passed for t in anchor_targets(result)] == [False] * 8


def test_issue_23_targets_not_measured_without_the_anchors():
    result = Comparison({"vitserve": "v"}, 10.0, 3, "x")
    assert {t.passed for t in anchor_targets(result)} == {None}
    assert anchor_targets(comparison(busy=True))[0].busy


def test_the_anchors_table_and_every_point_show_the_cores():
    result = comparison()
    result.missing["triton"] = "no venv"
    text = result.markdown()
    assert "### Targets" in text and "### Targets" in text
    assert "**triton: not measured:** no venv" in text
    row = "| base64 PNG | 64 | mosec | 1,600 (1,440-1,760) | 20.0 (20.0-20.0) | 60.0 (60.0-60.0) |"
    assert row + " 1.20 (1.20-1.20) | 1,333 |" in text
    assert "| FP32 tensor, /v2 | 64 | triton | 1,300 (1,300-1,300) |" in text
    assert "| vitserve | tensor | 1 | 64 | 1,600 (1,600-1,600) |" in text
    assert str(result.points[0]).endswith("p99 50.0 ms, 1.50 cores")
