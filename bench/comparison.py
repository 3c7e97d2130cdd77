"""The typed result of bench/compare.py, its issue-13 targets and its Markdown section."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.stats import Spread, fmt, median, ratio, spread_text, table

TARGET_LEVELS = (64, 256)
MiB = 1024  # KiB per MiB


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

    @property
    def images_per_s(self) -> float:
        return self.ok_rps * self.images

    def __str__(self) -> str:
        return (
            f"{self.server:<10} x{self.images:<2} c={self.concurrency:<3} {self.ok_rps:>7,.0f} "
            f"req/s, p99 {fmt(self.p99_ms, 1)} ms{' BUSY' if self.busy else ''}"
        )


@dataclass(frozen=True)
class Start:
    ready_s: Spread  # spawn to the first 200 of /health/ready
    load_s: Spread | None  # vitserve_model_load_seconds{phase="load"}
    warmup_s: Spread | None  # ... {phase="warmup"}
    rss_ready_kib: int | None
    peak_kib: int | None = None  # VmHWM after every load run


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

    def mine(self, server: str, images: int, concurrency: int) -> list[Point]:
        return [
            p
            for p in self.points
            if (p.server, p.images, p.concurrency) == (server, images, concurrency)
        ]

    def spread(self, server: str, images: int, c: int, attr: str = "ok_rps") -> Spread | None:
        return Spread.of(getattr(p, attr) for p in self.mine(server, images, c))

    def busy(self, server: str, images: int, c: int) -> bool:
        return any(p.busy for p in self.mine(server, images, c))

    def levels(self, server: str, images: int) -> list[int]:
        return sorted(
            {p.concurrency for p in self.points if (p.server, p.images) == (server, images)}
        )

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
        rows = []
        for c in TARGET_LEVELS:
            ours, plain = self.spread("vitserve", 1, c), self.spread("plain", 1, c)
            busy = self.busy("vitserve", 1, c) or self.busy("plain", 1, c)
            x = ratio(median(ours), median(plain))
            rows.append(
                Target(
                    f"c={c}, 1 image/request: >= 1.5x the plain server's req/s",
                    f"{x:.3f}x ({fmt(median(ours))} vs {fmt(median(plain))})" if x else "-",
                    None if x is None else x >= 1.5,
                    busy,
                )
            )
            ours, plain = (
                self.spread("vitserve", 1, c, "p99_ms"),
                self.spread("plain", 1, c, "p99_ms"),
            )
            both = ours is not None and plain is not None
            rows.append(
                Target(
                    f"c={c}, 1 image/request: lower p99 than the plain server",
                    f"{fmt(median(ours), 1)} vs {fmt(median(plain), 1)} ms" if both else "-",
                    ours.median < plain.median if both else None,
                    busy,
                )
            )
        batch, ceiling = self.best_ceiling()
        served = median(self.spread("vitserve", 1, 64, "images_per_s"))
        bare = median(self.spread("nomodel", 1, 64))
        x = ratio(served, median(ceiling))
        rows.append(
            Target(
                "c=64, 1 image/request: >= 90% of the in-process ceiling's images/s",
                f"{100 * x:.0f}% ({fmt(served)} vs {fmt(median(ceiling))} at batch {batch})"
                + (f"; with no model at all the plain server answers {fmt(bare)}" if bare else "")
                if x
                else "-",
                None if x is None else x >= 0.9,
                self.busy("vitserve", 1, 64),
            )
        )
        (c32, ours), (c1, plain) = self.best("vitserve", 32), self.best("plain", 1)
        x = ratio(ours, plain)
        rows.append(
            Target(
                "32 images/request: >= 1.5x the plain server's images/s (each at its best c)",
                f"{x:.3f}x ({fmt(ours)} at c={c32} vs {fmt(plain)} at c={c1})" if x else "-",
                None if x is None else x >= 1.5,
                bool(c32 and self.busy("vitserve", 32, c32))
                or bool(c1 and self.busy("plain", 1, c1)),
            )
        )
        ours, int8 = self.spread("vitserve", 1, 64), self.spread("int8", 1, 64)
        x = ratio(median(int8), median(ours))
        rows.append(
            Target(
                "c=64, 1 image/request: the int8 model >= 1.5x the fp32 model's images/s",
                f"{x:.3f}x ({fmt(median(int8))} vs {fmt(median(ours))})" if x else "-",
                None if x is None else x >= 1.5,
                self.busy("vitserve", 1, 64) or self.busy("int8", 1, 64),
            )
        )
        start = self.starts.get("vitserve")
        rows.append(
            Target(
                "start-up < 2 s (spawn to ready, slowest start)",
                f"{start.ready_s.high:.2f} s (median {start.ready_s.median:.2f})" if start else "-",
                None if start is None else start.ready_s.high < 2.0,
                False,
            )
        )
        peak = start.peak_kib if start else None
        rows.append(
            Target(
                "peak resident memory < 300 MiB (VmHWM after every load run, one process)",
                f"{peak / MiB:.0f} MiB" if peak else "-",
                None if peak is None else peak / MiB < 300,
                False,
            )
        )
        return rows

    def markdown(self) -> str:
        keys = list(self.labels)
        single = [k for k in keys if self.levels(k, 1)]
        out = [
            "## HTTP: vitserve against the servers a user would write",
            "",
            f"`hey` runs of {self.duration_s:g} s, {self.repeats} alternated repeat(s) per point; "
            "median (min-max). req/s counts 200 answers; p99 is over every answer. Servers: "
            + "; ".join(f"**{k}**: {label}" for k, label in self.labels.items())
            + f". Images: {self.images_source}.",
            "",
        ]
        if self.skipped:
            out += [f"**{self.skipped} runs skipped: past the time budget.**", ""]
        out += [
            "### Targets (issue 13)",
            "",
            table(
                ["target", "measured", "verdict"],
                [[t.name, t.measured, t.verdict] for t in self.targets()],
            ),
            "",
            "### Single-image requests: req/s (p99 ms)",
            "",
        ]
        rows = []
        for c in sorted({p.concurrency for p in self.points if p.images == 1}):
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
                ["server", "spawn to ready s", "load + warm-up s", "RSS ready MiB", "peak MiB"],
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
                    "images/request",
                    "c",
                    "req/s",
                    "images/s",
                    "p50 ms",
                    "p99 ms",
                    "avg batch",
                    "non-200",
                    "errors",
                    "busy runs",
                ],
                [self._row(k, n, c) for k in keys for n in (1, 32) for c in self.levels(k, n)],
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

    def _row(self, server: str, images: int, c: int) -> list[str]:
        points = self.mine(server, images, c)
        return [
            server,
            str(images),
            str(c),
            spread_text(self.spread(server, images, c)),
            spread_text(self.spread(server, images, c, "images_per_s")),
            spread_text(self.spread(server, images, c, "p50_ms"), 1),
            spread_text(self.spread(server, images, c, "p99_ms"), 1),
            spread_text(self.spread(server, images, c, "avg_batch"), 1),
            str(sum(p.not_ok for p in points)),
            str(sum(p.errors for p in points)),
            f"{sum(p.busy for p in points)}/{len(points)}",
        ]
