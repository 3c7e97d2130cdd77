"""A shadow at 100% against none: what the live traffic pays, and how much of it is compared.

Two services run side by side on copies of the shipped model's repository, each serving version 1 and
a copy of it as version 2 (the same files: every shadow answer must agree). One names version 2 the
candidate with ``vitserve_shadow_percent: 100``, the other names no candidate. ``hey`` loads them in
turn, alternated within each repeat (which goes first alternates too): c=64 single-image requests
(the machine saturated: the shadow should give way) and c=4 (idle time to spare: the shadow should
compare nearly every request). Reported, as medians over the repeats: live images/s and p99 of each
arm and their ratios (targets: >= 0.9x and <= 1.1x at c=64), the share of the shadowed service's
requests compared at c=4 (target >= 90%), what became of the other copies, whether every answer
of the shadowed service equals the other's on the same images (target: 0 changed), and the latency
gate's number for this byte-identical candidate: the model time ratio (the median of the shadow's
paired runs) and the pairs it rests on, read after each window (target: within 0.8-1.2 on a busy
machine; ``--busy N`` adds N processes that spin on the CPU for the whole run).

``python -m bench.shadow [--repeats 3] [--seconds 8] [--busy 2]`` prints the section for
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import hey
from bench.payloads import b64_pngs, predict_body
from bench.server_process import REPO, RunningServer, running_service
from bench.stats import Spread, fmt, median, ratio, spread_text, table
from service.contract.candidate_plan import CANDIDATE_VERSION, LIVE_VERSION, SHADOW_PERCENT
from service.contract.model_config import read_model_config, write_model_config

PORTS = range(18170, 18180)  # the upper half of bench.ab's: free_port skips a port in use
MODEL = "fashion-mnist-vit"
ARMS = ("none", "shadow")


def repository(root: Path, shadow: bool) -> Path:
    """The shipped model with version 1 copied as version 2, both served; ``shadow``: 2 is the
    candidate, shadowing every request."""
    copy = root / ("shadow" if shadow else "none") / "models"
    model = copy / MODEL
    shutil.copytree(REPO / "models" / MODEL, model)
    shutil.copytree(model / "1", model / "2")
    config = read_model_config(model / "config.pbtxt")
    config.version_policy.specific.versions[:] = [1, 2]
    config.parameters[LIVE_VERSION].string_value = "1"  # both answer from version 1
    if shadow:
        config.parameters[CANDIDATE_VERSION].string_value = "2"
        config.parameters[SHADOW_PERCENT].string_value = "100"
    write_model_config(config, model / "config.pbtxt")
    return copy


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.load(answer)


def post_json(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def comparison(server: RunningServer) -> dict:
    pairs = get_json(f"{server.url}/models/{MODEL}/shadow")["pairs"]
    return pairs[0] if pairs else {}


def outcomes(server: RunningServer) -> dict[str, int]:
    return dict(comparison(server).get("outcomes", {}))


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` processes that keep a core busy each (other work on a shared machine)."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


@dataclass(frozen=True)
class Window:
    arm: str
    concurrency: int
    images_s: float
    p99_ms: float | None
    failed: int
    outcomes: dict[str, int]  # the shadow's, during this window (shadow arm)
    model_time_ratio: float | None = None  # the shadow's paired runs so far (shadow arm)
    timed_pairs: int = 0

    @property
    def share_compared(self) -> float | None:
        total = sum(self.outcomes.values())
        return self.outcomes.get("compared", 0) / total if total else None


@dataclass(frozen=True)
class ShadowBench:
    windows: list[Window]
    changed: int  # answers of the shadowed service unlike the other's, on the same images
    checked: int
    agreement: float | None
    commands: list[str]
    busy: int = 0

    def spread(self, arm: str, concurrency: int, value: str) -> Spread | None:
        return Spread.of(
            getattr(w, value) for w in self.windows if (w.arm, w.concurrency) == (arm, concurrency)
        )

    def markdown(self) -> str:
        rows = []
        for concurrency in (64, 4):
            none_rate, shadow_rate = (self.spread(arm, concurrency, "images_s") for arm in ARMS)
            none_p99, shadow_p99 = (self.spread(arm, concurrency, "p99_ms") for arm in ARMS)
            share = self.spread("shadow", concurrency, "share_compared")
            rows.append(
                [
                    f"c={concurrency}",
                    spread_text(none_rate),
                    spread_text(shadow_rate),
                    fmt(ratio(median(shadow_rate), median(none_rate)), 2),
                    spread_text(none_p99, 1),
                    spread_text(shadow_p99, 1),
                    fmt(ratio(median(shadow_p99), median(none_p99)), 2),
                    "-"
                    if share is None
                    else f"{share.median:.0%} ({share.low:.0%}-{share.high:.0%})",
                ]
            )
        shed = {
            c: sum(w.outcomes.get("shed", 0) for w in self.windows if w.concurrency == c)
            for c in (64, 4)
        }
        failed = sum(w.failed for w in self.windows)
        gate = [w for w in self.windows if w.arm == "shadow" and w.model_time_ratio is not None]
        ratios = Spread.of(w.model_time_ratio for w in gate)
        pairs = max((w.timed_pairs for w in gate), default=0)
        busy = f" with {self.busy} processes spinning on the CPU throughout" if self.busy else ""
        return "\n".join(
            [
                "## A shadow at 100% against none",
                "",
                "Two services side by side, each serving the shipped model as versions 1 and 2 "
                "(the same files); one shadows every request on version 2 "
                "(`vitserve_candidate_version: 2`, `vitserve_shadow_percent: 100`). Single-image "
                "requests, the arms alternated within each repeat; medians (min-max) over "
                f"{len(self.windows) // 4} repeats. Live images/s and p99 of each arm; compared: "
                "the share of the shadowed service's requests that were compared in the window "
                "(the rest shed: "
                f"{shed[64]:,} at c=64, {shed[4]:,} at c=4, over all repeats). {failed} failed "
                f"requests. Answers changed by the shadow: {self.changed} of {self.checked} "
                f"(the same images to both services); top-1 agreement of the two versions "
                f"{fmt(self.agreement, 4)}.",
                "",
                table(
                    [
                        "load",
                        "none img/s",
                        "shadow img/s",
                        "ratio",
                        "none p99 ms",
                        "shadow p99 ms",
                        "ratio",
                        "compared",
                    ],
                    rows,
                ),
                "",
                "The latency gate on this byte-identical candidate (`model_ms.ratio_p50`, the "
                "median of candidate / live over the shadow's paired runs, read after each window"
                f"{busy}): {spread_text(ratios, 3)} (median, min-max over {len(gate)} windows), "
                f"resting on {pairs:,} timed pairs by the end.",
                "",
                "Commands:",
                "",
                *(f"- `{command}`" for command in self.commands),
            ]
        )


def load(arm: str, server: RunningServer, body: Path, concurrency: int, seconds: float) -> Window:
    before = outcomes(server)
    argv = hey.command(server.url + "/predict", body, concurrency=concurrency, duration_s=seconds)
    result = hey.run(argv, seconds + 90)
    time.sleep(1.0)  # the copies still queued run once the load stops
    pair = comparison(server)
    after = dict(pair.get("outcomes", {}))
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    times = pair.get("model_ms", {})
    return Window(
        arm,
        concurrency,
        result.ok_rps,
        result.ms(99),
        result.not_ok + result.error_count,
        delta,
        times.get("ratio_p50"),
        times.get("pairs", 0),
    )


def same_answers(servers: dict[str, RunningServer], images: list[str]) -> tuple[int, int]:
    """The two services' answers to the same images: how many differ, of how many."""
    changed = 0
    for image in images:
        body = predict_body([image])
        answers = [post_json(servers[arm].url + "/predict", body)["predictions"] for arm in ARMS]
        changed += answers[0] != answers[1]
    return changed, len(images)


def run(out: Path, repeats: int, seconds: float, spinners: int = 0) -> ShadowBench:
    out.mkdir(parents=True, exist_ok=True)
    images, _ = b64_pngs(32)
    body = out / "body-1.json"
    body.write_bytes(predict_body(images[:1]))
    windows: list[Window] = []
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-shadow-") as tmp:
        roots = {arm: repository(Path(tmp), arm == "shadow") for arm in ARMS}
        with (
            running_service(out / "none.log", ports=PORTS, model_repository=roots["none"]) as a,
            running_service(out / "shadow.log", ports=PORTS, model_repository=roots["shadow"]) as b,
        ):
            servers = {"none": a, "shadow": b}
            for server in servers.values():  # warm up: every front end and both versions
                hey.run(
                    hey.command(server.url + "/predict", body, concurrency=8, requests=400), 120
                )
            with busy(spinners):
                for repeat in range(repeats):
                    order = ARMS if repeat % 2 == 0 else ARMS[::-1]
                    for concurrency in (64, 4):
                        for arm in order:
                            windows.append(load(arm, servers[arm], body, concurrency, seconds))
            changed, checked = same_answers(servers, images)
            pair = get_json(f"{b.url}/models/{MODEL}/shadow")["pairs"][0]
    commands = [
        f"python -m bench.shadow --repeats {repeats} --seconds {seconds:g} --busy {spinners}",
        hey.shown(hey.command("URL", body, concurrency=64, duration_s=seconds)),
    ]
    return ShadowBench(windows, changed, checked, pair["top1_agreement"], commands, spinners)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.shadow", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench-shadow")
    arguments = parser.parse_args()
    bench = run(arguments.out, arguments.repeats, arguments.seconds, arguments.busy)
    print(bench.markdown())


if __name__ == "__main__":
    main()
