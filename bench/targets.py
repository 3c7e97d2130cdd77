"""The benchmark targets, each checked against one run's medians (bench/comparison.py): vitserve
against the plain server, and against the anchors mosec and Triton (docs/decisions.md#performance-targets)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from bench.stats import Spread, fmt, median, ratio

PNG, TENSOR = "png", "tensor"  # the kinds of request: base64 PNGs, or the model's FP32 tensor
TARGET_LEVELS = (64, 256)  # the concurrency levels of both sets of targets
ANCHOR_LEVELS = (1, 64, 256)  # the anchors' points for base64 PNGs ...
TENSOR_LEVELS = (64,)  # ... and for the FP32 tensor on /v2
MiB = 1024  # KiB per MiB


class Started(Protocol):
    """What the targets read of a server's starts (bench/comparison.py's ``Start``)."""

    @property
    def ready_s(self) -> Spread: ...

    @property
    def peak_kib(self) -> int | None: ...


class Run(Protocol):
    """What the targets read of one run: bench/comparison.py's ``Comparison``, which renders the
    targets, so it is named here by what it offers rather than imported back."""

    @property
    def starts(self) -> Mapping[str, Started]: ...

    def spread(
        self, server: str, images: int, c: int, attr: str = "ok_rps", *, kind: str = PNG
    ) -> Spread | None: ...

    def busy(self, server: str, images: int, c: int, *, kind: str = PNG) -> bool: ...

    def best(self, server: str, images: int) -> tuple[int | None, float | None]: ...

    def best_ceiling(self) -> tuple[int | None, Spread | None]: ...


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    passed: bool | None
    busy: bool

    @property
    def verdict(self) -> str:
        verdict = "NOT MEASURED" if self.passed is None else "PASS" if self.passed else "FAIL"
        return verdict + (" (busy machine: not a result)" if self.busy else "")


def plain_targets(result: Run) -> list[Target]:
    """The targets against the plain server: requests/s and p99, the ceiling, int8, start-up, memory."""
    rows = []
    for c in TARGET_LEVELS:
        what = f"c={c}, 1 image/request"
        rows.append(_faster(result, "plain", c, PNG, 1.5, what, whose="the plain server's"))
        rows.append(_lower_p99(result, "plain", c, what, whose="the plain server"))
    batch, ceiling = result.best_ceiling()
    served = median(result.spread("vitserve", 1, 64, "images_per_s"))
    bare = median(result.spread("nomodel", 1, 64))
    x = ratio(served, median(ceiling))
    rows.append(
        Target(
            "c=64, 1 image/request: >= 90% of the in-process ceiling's images/s",
            f"{100 * x:.0f}% ({fmt(served)} vs {fmt(median(ceiling))} at batch {batch})"
            + (f"; with no model at all the plain server answers {fmt(bare)}" if bare else "")
            if x
            else "-",
            None if x is None else x >= 0.9,
            result.busy("vitserve", 1, 64),
        )
    )
    (c32, ours), (c1, plain) = result.best("vitserve", 32), result.best("plain", 1)
    x = ratio(ours, plain)
    rows.append(
        Target(
            "32 images/request: >= 1.5x the plain server's images/s (each at its best c)",
            f"{x:.3f}x ({fmt(ours)} at c={c32} vs {fmt(plain)} at c={c1})" if x else "-",
            None if x is None else x >= 1.5,
            bool(c32 and result.busy("vitserve", 32, c32))
            or bool(c1 and result.busy("plain", 1, c1)),
        )
    )
    ours, int8 = result.spread("vitserve", 1, 64), result.spread("int8", 1, 64)
    x = ratio(median(int8), median(ours))
    rows.append(
        Target(
            "c=64, 1 image/request: the int8 model >= 1.5x the fp32 model's images/s",
            f"{x:.3f}x ({fmt(median(int8))} vs {fmt(median(ours))})" if x else "-",
            None if x is None else x >= 1.5,
            result.busy("vitserve", 1, 64) or result.busy("int8", 1, 64),
        )
    )
    rows.append(_start_up(result, "start-up", 2.0))
    rows.append(
        _peak_memory(
            result,
            "peak resident memory",
            300,
            "sum of VmHWM over the process tree, after every load run",
        )
    )
    return rows


def _faster(
    result: Run,
    than: str,
    c: int,
    kind: str,
    factor: float,
    what: str,
    whose: str | None = None,
) -> Target:
    """vitserve's req/s at least ``factor`` times ``than``'s (shown as ``whose``)."""
    ours, theirs = (result.spread(k, 1, c, kind=kind) for k in ("vitserve", than))
    x = ratio(median(ours), median(theirs))
    whose = whose or f"{than}'s"
    return Target(
        f"{what}: >= {factor:g}x {whose} req/s",
        f"{x:.3f}x ({fmt(median(ours))} vs {fmt(median(theirs))})" if x else "-",
        None if x is None else x >= factor,
        result.busy("vitserve", 1, c, kind=kind) or result.busy(than, 1, c, kind=kind),
    )


def _lower_p99(result: Run, than: str, c: int, what: str, whose: str | None = None) -> Target:
    """vitserve's p99 below ``than``'s (shown as ``whose``), base64 PNGs at ``c``."""
    ours, theirs = (result.spread(k, 1, c, "p99_ms") for k in ("vitserve", than))
    both = ours is not None and theirs is not None
    return Target(
        f"{what}: lower p99 than {whose or than}",
        f"{fmt(median(ours), 1)} vs {fmt(median(theirs), 1)} ms" if both else "-",
        ours.median < theirs.median if both else None,
        result.busy("vitserve", 1, c) or result.busy(than, 1, c),
    )


def anchor_targets(result: Run) -> list[Target]:
    """The targets against the anchors: ahead of mosec and Triton, c=1 as the plain server, memory,
    start-up."""
    rows = []
    for c in TARGET_LEVELS:
        what = f"c={c}, one base64 PNG per request"
        rows.append(_faster(result, "mosec", c, PNG, 1.15, what))
        rows.append(_lower_p99(result, "mosec", c, what))
    (c,) = TENSOR_LEVELS
    rows.append(_faster(result, "triton", c, TENSOR, 1.2, f"c={c}, FP32 JSON tensor on /v2"))
    ours, plain = (result.spread(k, 1, 1, "p50_ms") for k in ("vitserve", "plain"))
    x = ratio(median(ours), median(plain))
    rows.append(
        Target(
            "c=1, one base64 PNG per request: p50 within 5% of the plain server's",
            f"{fmt(median(ours), 2)} vs {fmt(median(plain), 2)} ms ({x:.3f}x)" if x else "-",
            None if x is None else x <= 1.05,
            result.busy("vitserve", 1, 1) or result.busy("plain", 1, 1),
        )
    )
    rows.append(
        _peak_memory(
            result,
            "peak RSS of all processes together",
            600,
            "sum of VmHWM over the process tree",
        )
    )
    rows.append(_start_up(result, "start-up to ready", 3.0))
    return rows


def _start_up(result: Run, what: str, limit_s: float) -> Target:
    """vitserve's slowest start, spawn to ready, under ``limit_s``."""
    start = result.starts.get("vitserve")
    return Target(
        f"{what} < {limit_s:g} s (spawn to ready, slowest start)",
        f"{start.ready_s.high:.2f} s (median {start.ready_s.median:.2f})" if start else "-",
        None if start is None else start.ready_s.high < limit_s,
        False,
    )


def _peak_memory(result: Run, what: str, limit_mib: int, how: str) -> Target:
    """vitserve's peak memory over its process tree (measured as ``how`` says) under ``limit_mib``."""
    start = result.starts.get("vitserve")
    peak = start.peak_kib if start else None
    return Target(
        f"{what} < {limit_mib} MiB ({how})",
        f"{peak / MiB:.0f} MiB" if peak else "-",
        None if peak is None else peak / MiB < limit_mib,
        False,
    )
