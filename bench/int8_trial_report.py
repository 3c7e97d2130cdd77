"""What bench/int8_trial.py measured, as a BENCHMARKS.md section: the offline and live agreement,
the promotion as service.promote decided it, and each version's served windows (images/s, latency,
the engine's and the front end's CPU an image, images a batch) with int8 over float."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.graphs import LABELS
from bench.stats import Spread, fmt, median, ratio, spread_text, table

FLOAT, INT8 = 1, 2  # the versions
ARMS = {FLOAT: "float (version 1)", INT8: "int8 dynamic (version 2, promoted)"}


def shadow_pair(report: dict) -> dict:
    """The live/candidate pair of a ``/shadow`` report (empty before any copy ran)."""
    pairs = [
        p
        for p in report.get("pairs", [])
        if (p["live_version"], p["candidate_version"])
        == (report.get("live_version"), report.get("candidate_version"))
    ]
    return pairs[0] if pairs else {}


def shown(argv: list[str]) -> str:
    return " ".join(["python", *argv[1:]]).replace(argv[argv.index("--url") + 1], "URL")


@dataclass(frozen=True)
class Promotion:
    argv: list[str]
    code: int
    log: str


@dataclass(frozen=True)
class Window:
    version: int
    repeat: int
    images_s: float
    p50_ms: float | None
    p99_ms: float | None
    failed: int
    other_cores: float
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per answered image, by role
    batch: float | None = None  # images per classifier batch in the window


ROLES = ("engine", "front end")  # bench/real_size.py's ``role`` of vitserve's processes


@dataclass
class Trial:
    size: str
    offline: dict
    report: dict
    sent: int
    sent_failed: int
    promotions: list[Promotion]
    live_after: int | None
    windows: list[Window] = field(default_factory=list)
    concurrency: int = 16
    seconds: float = 12.0
    command: str = "python -m bench.int8_trial"

    def spread(self, version: int, value: str) -> Spread | None:
        return Spread.of(getattr(w, value) for w in self.windows if w.version == version)

    def cpu_spread(self, version: int, role: str) -> Spread | None:
        return Spread.of(w.cpu_ms.get(role) for w in self.windows if w.version == version)

    def markdown(self) -> str:
        pair = shadow_pair(self.report)
        times = pair.get("model_ms", {})
        difference = pair.get("probability_difference", {})
        rows = []
        for version in (FLOAT, INT8):
            rows.append(
                [
                    ARMS[version],
                    spread_text(self.spread(version, "images_s"), 1),
                    spread_text(self.spread(version, "p50_ms")),
                    spread_text(self.spread(version, "p99_ms")),
                    *(spread_text(self.cpu_spread(version, role), 1) for role in ROLES),
                    spread_text(self.spread(version, "batch"), 1),
                    str(sum(w.failed for w in self.windows if w.version == version)),
                ]
            )
        rates = [median(self.spread(v, "images_s")) for v in (INT8, FLOAT)]
        p99s = [median(self.spread(v, "p99_ms")) for v in (INT8, FLOAT)]
        # CPU a image as a speed: float's over int8's, as images/s is int8's over float's
        cpus = [[median(self.cpu_spread(v, role)) for v in (FLOAT, INT8)] for role in ROLES]
        rows.append(
            [
                "int8 / float",
                times_text(ratio(*rates)),
                "",
                times_text(ratio(*p99s)),
                *(times_text(ratio(*pair)) for pair in cpus),
                "",
                "",
            ]
        )
        others = Spread.of(w.other_cores for w in self.windows)
        offline = self.offline
        lines = [
            f"## An int8 {LABELS[self.size]} promoted through the shadow",
            "",
            f"Command: `{self.command}`.",
            "",
            f"Offline, on {offline['images']} of the trial photos (in version 2's metadata): top-1 "
            f"agreement {fmt(offline['top1_agreement'], 4)}, largest |p_int8 - p_float| p99 "
            f"{offline['probability_difference_p99']:.2g}, max "
            f"{offline['probability_difference_max']:.2g}.",
            "",
            f"The shadow, after {self.sent} requests ({self.sent_failed} not answered 200), one "
            f"distinct 640 x 480 JPEG each: {pair.get('requests_compared', 0)} compared, top-1 "
            f"agreement {fmt(pair.get('top1_agreement'), 4)}, |p_live - p_candidate| mean "
            f"{fmt(difference.get('mean'), 4)} p99 {fmt(difference.get('p99'), 4)}, model time "
            f"ratio {fmt(times.get('ratio_p50'), 3)} over {times.get('pairs', 0)} timed pairs of "
            f"shadow batches (a batch's p50: live {fmt(times.get('live_p50'))} ms, candidate "
            f"{fmt(times.get('candidate_p50'))} ms); copies: {pair.get('outcomes', {})}.",
            "",
            "Promotion:",
            "",
            *(f"- `{shown(p.argv)}`: exit {p.code}: {last_line(p.log)}" for p in self.promotions),
            f"- unversioned requests answered by version {self.live_after} after it",
            "",
            f"Served at c={self.concurrency}, one 640 x 480 JPEG a request, `hey` for "
            f"{self.seconds:g} s a window, the versions alternated, medians (min-max) over "
            f"{len(self.windows) // 2} repeats; other processes used {spread_text(others, 2)} "
            f"cores during the windows; CPU ms a image: the CPU time of the server's processes in "
            f"each role over the window, per image answered (the last row: float's over int8's):",
            "",
            table(
                [
                    "version",
                    "images/s",
                    "p50 ms",
                    "p99 ms",
                    *(f"{r} CPU ms" for r in ROLES),
                    "images a batch",
                    "failed",
                ],
                rows,
            ),
        ]
        return "\n".join(lines)


def times_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def last_line(log: str) -> str:
    """service.promote's decision: its last log line, less the timestamp and level."""
    line = log.splitlines()[-1] if log else ""
    for level in (" WARNING ", " INFO ", " ERROR "):
        line = line.partition(level)[2] or line
    return line
