"""The typed result of bench/compare.py and its Markdown section (the targets: bench/targets.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bench.stats import Spread, fmt, median, ratio, spread_text, table
from bench.targets import (
    ANCHOR_LEVELS,
    PNG,
    TENSOR,
    TENSOR_LEVELS,
    MiB,
    Target,
    anchor_targets,
    plain_targets,
)

ANCHOR_POINTS = [(PNG, c) for c in ANCHOR_LEVELS] + [(TENSOR, c) for c in TENSOR_LEVELS]
ANCHOR_SERVERS = ("vitserve", "plain", "mosec", "triton")  # and the other vitserve row, w<count>


@dataclass(frozen=True)
class Point:
    server: str
    images: int
    concurrency: int
    repeat: int
    ok_rps: float
    p50_ms: float | None
    p99_ms: float | None
    not_ok: int
    errors: int
    busy: bool
    avg_batch: float | None = None
    kind: str = PNG  # or TENSOR (bench/contenders.py)
    cores: float | None = None  # used by the server's whole process tree during the run

    @property
    def images_per_s(self) -> float:
        return self.ok_rps * self.images

    def __str__(self) -> str:
        return (
            f"{self.server:<10} {self.kind:<6} x{self.images:<2} c={self.concurrency:<3} "
            f"{self.ok_rps:>7,.0f} req/s, p99 {fmt(self.p99_ms, 1)} ms, "
            f"{fmt(self.cores, 2)} cores{' BUSY' if self.busy else ''}"
        )


@dataclass(frozen=True)
class Start:
    ready_s: Spread  # spawn to the first 200 of the server's readiness route
    load_s: Spread | None  # vitserve_model_load_seconds{phase="load"}
    warmup_s: Spread | None  # ... {phase="warmup"}
    rss_ready_kib: int | None  # summed over the process tree, as peak_kib
    peak_kib: int | None = None  # VmHWM after every load run


@dataclass
class Comparison:
    labels: dict[str, str]
    duration_s: float
    repeats: int
    images_source: str
    ceiling_processes: int = 0
    points: list[Point] = field(default_factory=list)
    ceiling: dict[int, list[float]] = field(default_factory=dict)  # batch -> images/s samples
    starts: dict[str, Start] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    skipped: int = 0
    missing: dict[str, str] = field(default_factory=dict)  # server -> why it was not measured

    def mine(self, server: str, images: int, concurrency: int, kind: str = PNG) -> list[Point]:
        key = (server, images, concurrency, kind)
        return [p for p in self.points if (p.server, p.images, p.concurrency, p.kind) == key]

    def spread(
        self, server: str, images: int, c: int, attr: str = "ok_rps", *, kind: str = PNG
    ) -> Spread | None:
        return Spread.of(getattr(p, attr) for p in self.mine(server, images, c, kind))

    def busy(self, server: str, images: int, c: int, *, kind: str = PNG) -> bool:
        return any(p.busy for p in self.mine(server, images, c, kind))

    def levels(self, server: str, images: int, kind: str = PNG) -> list[int]:
        key = (server, images, kind)
        return sorted({p.concurrency for p in self.points if (p.server, p.images, p.kind) == key})

    def best(self, server: str, images: int) -> tuple[int | None, float | None]:
        """The concurrency with the most images/s, and that median."""
        found = [
            (median(self.spread(server, images, c, "images_per_s")), c)
            for c in self.levels(server, images)
        ]
        found = [(v, c) for v, c in found if v is not None]
        return (max(found)[1], max(found)[0]) if found else (None, None)

    def best_ceiling(self) -> tuple[int | None, Spread | None]:
        spreads = {b: Spread.of(v) for b, v in self.ceiling.items() if v}
        if not spreads:
            return None, None
        batch = max(spreads, key=lambda b: spreads[b].median)
        return batch, spreads[batch]

    def targets(self) -> list[Target]:
        return plain_targets(self)

    def markdown(self) -> str:
        keys = list(self.labels)
        single = [k for k in keys if self.levels(k, 1)]
        out = [
            "## HTTP: vitserve against the servers a user would write, and against mosec and Triton",
            "",
            f"`hey` runs of {self.duration_s:g} s, {self.repeats} alternated repeat(s) per point "
            "(at c=1 one client sends to every server in turn, half a second each, every request "
            "timed to the microsecond: bench/one_client.py); "
            "median (min-max). req/s counts 200 answers; p99 is over every answer; cores: CPU "
            "time of the server's whole process tree per second of the run. Servers: "
            + "; ".join(f"**{k}**: {label}" for k, label in self.labels.items())
            + f". Images: {self.images_source}.",
            "",
        ]
        if self.skipped:
            out += [f"**{self.skipped} runs skipped: past the time budget.**", ""]
        out += [f"**{k}: not measured:** {why}" for k, why in self.missing.items()]
        out += ["", *self._targets("issue 13", self.targets())]
        out += [*self._targets("issue 23", anchor_targets(self)), *self._anchors()]
        out += [
            "### Single-image requests: req/s (p99 ms)",
            "",
        ]
        rows = []
        for c in sorted({p.concurrency for p in self.points if (p.images, p.kind) == (1, PNG)}):
            cells = [self._with_p99(k, 1, c, "ok_rps") for k in single]
            x = ratio(median(self.spread("vitserve", 1, c)), median(self.spread("plain", 1, c)))
            rows.append([str(c), *cells, f"{x:.2f}x" if x else "-"])
        out += [table(["c", *single, "vitserve / plain"], rows), ""]
        out += [
            "### 32-image requests: images/s (p99 ms); the plain server gets the same images one "
            "per request",
            "",
        ]
        rows = []
        for c in self.levels("vitserve", 32):
            ours = self.spread("vitserve", 32, c, "images_per_s")
            plain = self.spread("plain", 1, c, "images_per_s")
            x = ratio(median(ours), median(plain))
            rows.append(
                [
                    str(c),
                    self._with_p99("vitserve", 32, c, "images_per_s"),
                    spread_text(plain),
                    f"{x:.2f}x" if x else "-",
                ]
            )
        out += [table(["c", "vitserve, 32/request", "plain, 1/request", "ratio"], rows), ""]
        batch, _ = self.best_ceiling()
        out += [
            "### In-process ceiling: base64 + decode + preprocess + model, no HTTP, "
            f"{self.ceiling_processes} worker processes",
            "",
            table(
                ["batch", "images/s"],
                [
                    [f"{b}{' (best)' if b == batch else ''}", spread_text(Spread.of(v))]
                    for b, v in self.ceiling.items()
                ],
            ),
            "",
            "### Start-up and memory",
            "",
            table(
                [
                    "server",
                    "spawn to ready s",
                    "load + warm-up s",
                    "RSS ready MiB, all processes",
                    "peak MiB, all processes",
                ],
                [
                    [
                        k,
                        s.ready_s.text(2),
                        f"{spread_text(s.load_s, 2)} + {spread_text(s.warmup_s, 2)}"
                        if s.load_s or s.warmup_s
                        else "-",
                        fmt(s.rss_ready_kib / MiB if s.rss_ready_kib else None),
                        fmt(s.peak_kib / MiB if s.peak_kib else None),
                    ]
                    for k, s in self.starts.items()
                ],
            ),
            "",
            "### Every point",
            "",
            table(
                [
                    "server",
                    "request",
                    "images/request",
                    "c",
                    "req/s",
                    "images/s",
                    "p50 ms",
                    "p99 ms",
                    "avg batch",
                    "cores",
                    "non-200",
                    "errors",
                    "busy runs",
                ],
                [
                    self._row(k, n, c, kind)
                    for k in keys
                    for kind in (PNG, TENSOR)
                    for n in (1, 32)
                    for c in self.levels(k, n, kind)
                ],
            ),
            "",
            "Commands:",
            "",
            *(f"- `{command}`" for command in self.commands),
        ]
        return "\n".join(out)

    def _with_p99(self, server: str, images: int, c: int, attr: str) -> str:
        p99 = median(self.spread(server, images, c, "p99_ms"))
        return f"{spread_text(self.spread(server, images, c, attr))} ({fmt(p99, 1)})"

    def _row(self, server: str, images: int, c: int, kind: str) -> list[str]:
        points = self.mine(server, images, c, kind)

        def cell(attr: str, digits: int = 0) -> str:
            return spread_text(self.spread(server, images, c, attr, kind=kind), digits)

        return [
            server,
            kind,
            str(images),
            str(c),
            cell("ok_rps"),
            cell("images_per_s"),
            cell("p50_ms", 1),
            cell("p99_ms", 1),
            cell("avg_batch", 1),
            cell("cores", 2),
            str(sum(p.not_ok for p in points)),
            str(sum(p.errors for p in points)),
            f"{sum(p.busy for p in points)}/{len(points)}",
        ]

    @staticmethod
    def _targets(issue: str, targets: list[Target]) -> list[str]:
        rows = [[t.name, t.measured, t.verdict] for t in targets]
        return [f"### Targets ({issue})", "", table(["target", "measured", "verdict"], rows), ""]

    def _anchors(self) -> list[str]:
        """The anchors' points, each server's row beside the others'."""
        rows = []
        counts = [k for k in self.labels if re.fullmatch(r"w\d+", k)]
        shown = [ANCHOR_SERVERS[0], *counts, *ANCHOR_SERVERS[1:]]
        for kind, c in ANCHOR_POINTS:
            for key in (k for k in shown if self.mine(k, 1, c, kind)):
                rps, cores = (self.spread(key, 1, c, a, kind=kind) for a in ("ok_rps", "cores"))
                per_core = ratio(median(rps), median(cores))
                rows.append(
                    [
                        "base64 PNG" if kind == PNG else "FP32 tensor, /v2",
                        str(c),
                        key,
                        spread_text(rps),
                        spread_text(self.spread(key, 1, c, "p50_ms", kind=kind), 1),
                        spread_text(self.spread(key, 1, c, "p99_ms", kind=kind), 1),
                        spread_text(cores, 2),
                        fmt(per_core),
                    ]
                )
        headers = ["request", "c", "server", "req/s", "p50 ms", "p99 ms", "cores", "req/s per core"]
        return [
            "### Against mosec and Triton (issue 23): one request at a time per client",
            "",
            table(headers, rows),
            "",
        ]
