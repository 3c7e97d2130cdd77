"""BENCHMARKS.md from the JSON the benchmarks wrote: tables of medians with their spread, the issue's
targets with PASS/FAIL, and what was not measured.

``python -m bench.report RESULTS_DIR [--output BENCHMARKS.md]`` regenerates the document from a
results directory without measuring anything again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.stats import fmt, fmt_spread, ratio

TARGET_CONCURRENCY = 64
ATTENTION_TOLERANCE = 0.98  # the classifier graph may be at most 2% slower (timing noise)


def _level(service: dict | None, case: str, concurrency: int) -> dict | None:
    if not service:
        return None
    return service.get("summary", {}).get(case, {}).get("levels", {}).get(str(concurrency))


def _median(summary: dict | None, key: str) -> float | None:
    if not summary or not summary.get(key):
        return None
    return summary[key].get("median")


def paired_wins(pair: dict | None) -> str | None:
    """How many interleaved repeats model.onnx won, e.g. "9 of 15" (None without raw samples)."""
    samples = (pair or {}).get("samples")
    if not samples:
        return None
    classifier, attention = samples["model.onnx"], samples["attention.onnx"]
    wins = sum(c > a for c, a in zip(classifier, attention, strict=True))
    return f"{wins} of {len(classifier)}"


def _verdict(passed: bool | None) -> str:
    if passed is None:
        return "NOT MEASURED"
    return "PASS" if passed else "FAIL"


def targets(engine: dict | None, service: dict | None) -> list[dict]:
    """The issue's targets: one row each with what was measured and PASS / FAIL / NOT MEASURED."""
    rows: list[dict] = []
    c = TARGET_CONCURRENCY
    batching, nobatch, baseline = (
        _level(service, "batching", c),
        _level(service, "no-batching", c),
        _level(service, "baseline", c),
    )
    busy = any(level and level.get("busy_runs") for level in (batching, nobatch, baseline))

    def row(target: str, measured: str, passed: bool | None, busy_inputs: bool = False) -> None:
        rows.append(
            {
                "target": target,
                "measured": measured,
                "verdict": _verdict(passed),
                "busy": busy_inputs,
            }
        )

    service_rps, baseline_rps = _median(batching, "ok_rps"), _median(baseline, "ok_rps")
    x = ratio(service_rps, baseline_rps)
    row(
        f"c={c}, 1 image/request: >= 3x the baseline's requests/s",
        f"{x:.2f}x ({fmt(service_rps)} vs {fmt(baseline_rps)} req/s)" if x else "-",
        None if x is None else x >= 3.0,
        busy,
    )
    service_p99, baseline_p99 = _median(batching, "p99_ms"), _median(baseline, "p99_ms")
    row(
        f"c={c}, 1 image/request: lower p99 than the baseline",
        f"{fmt(service_p99, 1)} vs {fmt(baseline_p99, 1)} ms"
        if service_p99 is not None and baseline_p99 is not None
        else "-",
        None if service_p99 is None or baseline_p99 is None else service_p99 < baseline_p99,
        busy,
    )
    nobatch_rps = _median(nobatch, "ok_rps")
    x = ratio(service_rps, nobatch_rps)
    row(
        f"c={c}, 1 image/request: >= 1.3x the service with batching off",
        f"{x:.2f}x ({fmt(service_rps)} vs {fmt(nobatch_rps)} req/s)" if x else "-",
        None if x is None else x >= 1.3,
        busy,
    )
    ceiling = _median(service, "ceiling_images_per_s") if service else None
    best_level, best = None, None
    for level, values in (
        (service or {}).get("summary", {}).get("batch32", {}).get("levels", {}).items()
    ):
        value = _median(values, "images_per_s")
        if value is not None and (best is None or value > best):
            best_level, best = level, value
    x = ratio(best, ceiling)
    batch32_busy = bool(best_level and _level(service, "batch32", int(best_level)).get("busy_runs"))
    row(
        "32 images/request: >= 70% of the in-process ceiling's images/s (best concurrency)",
        f"{100 * x:.0f}% ({fmt(best)} img/s at c={best_level} vs ceiling {fmt(ceiling)})"
        if x
        else "-",
        None if x is None else x >= 0.70,
        batch32_busy,
    )
    startup = (service or {}).get("startup_s", {}).get("service")
    start_median = startup.get("median") if startup else None
    row(
        "start-up to ready (spawn to /health/ready 200) < 5 s, shipped model, CPU (slowest start)",
        f"{fmt_spread(startup, 2)} s" if start_median is not None else "-",
        None if start_median is None else startup["max"] < 5.0,
        bool((service or {}).get("startup_busy", {}).get("busy")),
    )
    memory = (service or {}).get("memory_kib", {}).get("service") or {}
    peak, now = memory.get("VmHWM"), memory.get("VmRSS")
    row(
        "resident memory of the service < 300 MB (peak VmHWM after the whole sweep)",
        f"peak {peak / 1024:.0f} MiB, now {now / 1024:.0f} MiB" if peak and now else "-",
        None if not peak else peak / 1024 < 300,
        bool((service or {}).get("startup_busy", {}).get("busy")),
    )
    pair = (engine or {}).get("classifier_vs_attention", {}).get("32")
    x = pair["classifier_over_attention"]["median"] if pair else None
    row(
        "/predict pays nothing for attention: model.onnx at least as fast as attention.onnx, "
        f"batch 32 (within {100 * (1 - ATTENTION_TOLERANCE):.0f}%)",
        f"{x:.3f}x, median of per-repeat ratios"
        + (f"; model.onnx faster in {paired_wins(pair)} repeats" if paired_wins(pair) else "")
        + f" (medians {fmt(_median(pair, 'model.onnx'))} vs "
        f"{fmt(_median(pair, 'attention.onnx'))} img/s)"
        if x
        else "-",
        None if x is None else x >= ATTENTION_TOLERANCE,
        bool((engine or {}).get("busy")),
    )
    return rows


def findings(engine: dict | None, micro: dict | None, service: dict | None) -> list[list[str]]:
    """Each tuning option next to what the service does now: [option, variant, default, ratio, source]."""
    rows: list[list[str]] = []
    summary = (service or {}).get("summary", {})
    defaults = summary.get("batching", {}).get("levels", {})
    for key, entry in summary.items():
        if not key.startswith("service-"):
            continue
        for level, values in entry["levels"].items():
            base = defaults.get(level)
            variant_rps, base_rps = _median(values, "ok_rps"), _median(base, "ok_rps")
            x = ratio(variant_rps, base_rps)
            rows.append(
                [
                    entry["label"],
                    f"{fmt(variant_rps)} req/s, p99 {fmt(_median(values, 'p99_ms'), 1)} ms",
                    f"{fmt(base_rps)} req/s, p99 {fmt(_median(base, 'p99_ms'), 1)} ms",
                    f"{x:.2f}x" if x else "-",
                    f"HTTP, c={level}",
                ]
            )
    pipeline = (micro or {}).get("pipeline", {})
    names = list(pipeline)
    if names:
        base = _median_of(pipeline[names[0]])
        for name in names[1:]:
            value = _median_of(pipeline[name])
            x = ratio(value, base)
            rows.append(
                [
                    f"onnxruntime {name} (service: {names[0].partition(': ')[2] or names[0]})",
                    f"{fmt(value)} img/s",
                    f"{fmt(base)} img/s",
                    f"{x:.2f}x" if x else "-",
                    "pipeline: preprocess thread + onnxruntime, batch 32",
                ]
            )
    sessions = (micro or {}).get("session_options", {})
    names = [n for n in sessions if not n.startswith("_")]
    if names:
        default = sessions[names[0]]
        largest = list(default["batches"])[-1]
        for name in names[1:]:
            entry = sessions[name]
            value = _median_of(entry["batches"][largest])
            base = _median_of(default["batches"][largest])
            x = ratio(value, base)
            rows.append(
                [
                    f"onnxruntime session: {name}",
                    f"{fmt(value)} img/s at batch {largest}, created in "
                    f"{fmt(_median_of(entry['create_ms']))} ms",
                    f"{fmt(base)} img/s, {fmt(_median_of(default['create_ms']))} ms",
                    f"{x:.2f}x" if x else "-",
                    "in-process, engine only",
                ]
            )
    first = (micro or {}).get("first_run")
    if first:
        rows.append(
            [
                f"warm-up of every batch size 1-{first['sizes']} (service now) vs none",
                f"first runs {first['first_runs_s']:.3f} s",
                f"warm runs {first['second_runs_s']:.3f} s",
                f"{first['first_over_second']:.2f} (first / warm)",
                "in-process: is there a first-run cost to hide?",
            ]
        )
    request = (micro or {}).get("request_us", {})
    for count in (1, 32):
        prefix = f"{count} image(s): "
        service_path = next(
            (v for k, v in request.items() if k.startswith(prefix + "response, service")), None
        )
        proposal = next(
            (v for k, v in request.items() if k.startswith(prefix + "response, proposal")), None
        )
        if service_path and proposal:
            x = ratio(_median_of(service_path), _median_of(proposal))
            rows.append(
                [
                    f"/predict response for {count} image(s): one numpy pass + orjson",
                    f"{fmt(_median_of(proposal), 1)} us",
                    f"{fmt(_median_of(service_path), 1)} us",
                    f"{x:.1f}x faster" if x else "-",
                    "in-process, per request",
                ]
            )
    return rows


def _median_of(summary: dict | None) -> float | None:
    return summary.get("median") if summary else None


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _statuses(level: dict) -> str:
    codes = {k: v for k, v in level.get("status_codes", {}).items() if k != "200"}
    parts = [f"{v}x{k}" for k, v in sorted(codes.items())]
    if level.get("errors"):
        parts.append(f"{level['errors']} errors")
    return ", ".join(parts) or "0"


def service_section(service: dict) -> list[str]:
    out = [
        "## Service under load",
        "",
        f"`hey` runs of {service['duration_s']:g} s each, {service['repeats']} repeat(s) per point, "
        "interleaved across cases; medians with (min-max) over the repeats. req/s counts 200 "
        "answers only; images/s = req/s x images per request. Latency percentiles are hey's, over "
        "every answered request (non-200 included, see the last columns). avg batch: images per "
        "onnxruntime run, from the service's own /metrics during the run.",
        "",
    ]
    labels = {c["key"]: c for c in service.get("cases", [])}
    for key, entry in service.get("summary", {}).items():
        case = labels.get(key, {})
        server = service.get("servers", {}).get(case.get("server"), {})
        env = " ".join(f"{k}={v}" for k, v in server.get("env", {}).items()) or "(no env)"
        commands = [p["command"] for p in service.get("points", []) if p.get("case") == key]
        out += [
            f"### {entry['label']}",
            "",
            f"`{case.get('path', '')}`, body `{case.get('body', '')}` "
            f"({service.get('body_bytes', {}).get(case.get('body'), '?')} bytes); server: "
            f"`{env} python {_shorten(server.get('argv', ''))}`; load: `{_shorten(commands[-1]) if commands else '-'}`",
            "",
        ]
        rows = []
        for level, values in entry["levels"].items():
            rows.append(
                [
                    level,
                    fmt_spread(values["ok_rps"]),
                    fmt_spread(values["images_per_s"]),
                    fmt_spread(values["p50_ms"], 1),
                    fmt_spread(values["p90_ms"], 1),
                    fmt_spread(values["p99_ms"], 1),
                    fmt_spread(values.get("avg_batch_size"), 1),
                    _statuses(values),
                    f"{values['busy_runs']}/{values['runs']}",
                ]
            )
        out += [
            table(
                [
                    "concurrency",
                    "req/s",
                    "images/s",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "avg batch",
                    "non-200 / errors",
                    "busy runs",
                ],
                rows,
            ),
            "",
        ]
    return out


def engine_section(engine: dict) -> list[str]:
    out = [
        "## Engine: onnxruntime vs PyTorch eager",
        "",
        f"Same weights, {engine.get('threads', '?')} thread(s) each (`torch.set_num_threads`, onnxruntime "
        "`intra_op_num_threads`; otherwise the service's session options), random inputs, "
        f"{engine.get('repeats', '?')} interleaved repeats of at least {engine.get('min_time_s', '?')} s "
        "per point; "
        "images/s, median (min-max). PyTorch runs under `torch.inference_mode()` with fused "
        "attention (`scaled_dot_product_attention`).",
        "",
    ]
    for name, model in engine.get("models", {}).items():
        config = model["config"]
        shape = (
            f"{config['in_channels']}x{config['image_height']}x{config['image_width']}, patch "
            f"{config['patch_size']}, dim {config['dim']}, depth {config['depth']}, heads "
            f"{config['heads']}, mlp {config['mlp_dim']}, {model['parameters']:,} parameters"
        )
        out += [f"### {name}", "", shape, ""]
        if "export_seconds" in model:
            out += [
                f"Randomly initialised and exported for this run with `export.onnx.to_onnx` in "
                f"{model['export_seconds']:.1f} s.",
                "",
            ]
        rows = [
            [
                batch,
                fmt_spread(values["onnxruntime"]),
                fmt_spread(values["pytorch"]),
                f"{values['onnxruntime_over_pytorch']:.2f}x",
            ]
            for batch, values in model["batches"].items()
        ]
        out += [
            table(
                ["batch", "onnxruntime img/s", "PyTorch eager img/s", "onnxruntime / PyTorch"], rows
            ),
            "",
        ]
    pairs = engine.get("classifier_vs_attention")
    if pairs:
        out += [
            "### The classifier graph vs the attention graph (shipped model, onnxruntime)",
            "",
            "`model.onnx` is what `/predict` runs (logits only); `attention.onnx` is the same graph "
            "with a second output, every layer's attention probabilities. Ratio: "
            "model.onnx / attention.onnx images/s within each interleaved repeat, median (min-max); "
            "the medians of the two columns need not give the same ratio on a noisy machine, so "
            "the last column counts the repeats model.onnx won.",
            "",
            table(
                [
                    "batch",
                    "model.onnx img/s",
                    "attention.onnx img/s",
                    "ratio",
                    "model.onnx faster in",
                ],
                [
                    [
                        batch,
                        fmt_spread(values["model.onnx"]),
                        fmt_spread(values["attention.onnx"]),
                        fmt_spread(values["classifier_over_attention"], 3),
                        paired_wins(values) or "-",
                    ]
                    for batch, values in pairs.items()
                ],
            ),
            "",
        ]
    exports = engine.get("classifier_exports")
    if exports:
        rows = []
        for batch, variants in exports["batches"].items():
            for name, values in variants.items():
                shipped = name == exports["shipped"]
                rows.append(
                    [
                        batch,
                        name,
                        exports["nodes"][name],
                        fmt_spread(values["images_per_s"]),
                        "1" if shipped else fmt_spread(values["over_shipped"], 3),
                        "-" if shipped else f"{values['wins_over_shipped']} of {values['repeats']}",
                    ]
                )
        out += [
            "### How the classifier graph is exported (shipped weights, onnxruntime)",
            "",
            "The shipped weights exported as a classifier three ways, run with the service's session "
            "options: the explicit softmax path at opset 18 (what `export.onnx` writes as "
            "`model.onnx`), `scaled_dot_product_attention` at opset 18 (which the exporter spells "
            "as the same matrix products plus shape nodes), and the same at opset 23 (one ONNX "
            "`Attention` op a layer). Ratio: images/s over the shipped export's within each "
            "interleaved repeat. Opset 23 is not shipped whatever it measures here: onnxruntime's "
            "CUDA kernel for `Attention` could not be checked on a GPU, and Triton servers with an "
            "older onnxruntime cannot load it.",
            "",
            table(
                ["batch", "export", "nodes", "img/s", "ratio to shipped", "faster than shipped in"],
                rows,
            ),
            "",
        ]
    return out


def micro_section(micro: dict) -> list[str]:
    out = [
        "## Tuning measurements (in-process)",
        "",
        f"`python -m bench.micro`: {micro['repeats']} interleaved repeats of at least "
        f"{micro['min_time_s']:g} s per point; median (min-max).",
        "",
    ]
    sessions = micro.get("session_options", {})
    names = [n for n in sessions if not n.startswith("_")]
    if names:
        batches = list(sessions[names[0]]["batches"])
        out += [
            "### onnxruntime session options, shipped classifier",
            "",
            "Images/s at each batch size, and the time to create the session. The offline-optimised "
            f"file ({sessions.get('_offline_file_bytes', 0) / 1e6:.2f} MB) was written by "
            "onnxruntime with ENABLE_ALL on this machine (`optimized_model_filepath`).",
            "",
            table(
                ["session", *[f"batch {b} img/s" for b in batches], "create ms"],
                [
                    [
                        name,
                        *[fmt_spread(sessions[name]["batches"][b]) for b in batches],
                        fmt_spread(sessions[name]["create_ms"], 0),
                    ]
                    for name in names
                ],
            ),
            "",
        ]
    first = micro.get("first_run")
    if first:
        out += [
            "### Warm-up: a new batch size vs a warm one (fresh session, service options)",
            "",
            f"Every batch size 1-{first['sizes']} run once (what the service's warm-up does): "
            f"{first['first_runs_s']:.3f} s; the same runs again: {first['second_runs_s']:.3f} s "
            f"(ratio {first['first_over_second']:.2f}). Batch 1, first run "
            f"{first['batch1_first_ms']:.1f} ms vs {first['batch1_second_ms']:.1f} ms again. A "
            "ratio near 1 means the CPU provider has no per-shape first-run cost for the warm-up "
            "to hide.",
            "",
        ]
    pipeline = micro.get("pipeline")
    if pipeline:
        out += [
            "### Pipeline: preprocessing thread + onnxruntime thread, batches of 32",
            "",
            "One thread decodes and preprocesses 28x28 PNG files with the service's Preprocessor "
            "while another runs onnxruntime on the batches, as the service overlaps them. "
            "Images/s through both.",
            "",
            table(
                ["session", "images/s"],
                [[name, fmt_spread(values)] for name, values in pipeline.items()],
            ),
            "",
        ]
    pre = micro.get("preprocessing_us")
    if pre:
        out += [
            "### Decode + preprocess, per image",
            "",
            table(["input", "microseconds"], [[name, fmt_spread(v, 1)] for name, v in pre.items()]),
            "",
        ]
    request = micro.get("request_us")
    if request:
        out += [
            "### Request parsing and response building, per request",
            "",
            "The proposal builds the same JSON document (checked equal) from a whole batch of "
            "logits in one numpy pass and one `orjson.dumps`, instead of one `prediction()` and "
            "pydantic objects per image re-validated by the response model.",
            "",
            table(
                ["step", "microseconds"],
                [[name, fmt_spread(v, 1)] for name, v in request.items()],
            ),
            "",
        ]
    return out


def variants_section(service: dict) -> list[str]:
    summary = service.get("summary", {})
    variants = [k for k in summary if k.startswith("service-")]
    if not variants:
        return []
    base = summary.get("batching", {}).get("levels", {})
    rows = []
    for key in variants:
        for level, values in summary[key]["levels"].items():
            default = base.get(level)
            x = ratio(_median(values, "ok_rps"), _median(default, "ok_rps"))
            rows.append(
                [
                    summary[key]["label"],
                    level,
                    fmt_spread(values["ok_rps"]),
                    fmt_spread(default["ok_rps"]) if default else "-",
                    f"{x:.2f}x" if x else "-",
                    fmt_spread(values["p99_ms"], 1),
                    fmt_spread(default["p99_ms"], 1) if default else "-",
                    f"{values['busy_runs']}/{values['runs']}",
                ]
            )
    return [
        "### Service settings, side by side (1 image/request)",
        "",
        "Each variant is the service with one setting changed, run in the same interleaved sweep "
        "as the defaults.",
        "",
        table(
            [
                "variant",
                "concurrency",
                "req/s",
                "defaults req/s",
                "variant / defaults",
                "p99 ms",
                "defaults p99 ms",
                "busy runs",
            ],
            rows,
        ),
        "",
    ]


CUDA_SECTION = """## The CUDA path (not measured)

No GPU was available on the machine that produced these numbers, so nothing on the CUDA path has been
measured: every figure above is onnxruntime's CPU execution provider. What the service does on a GPU
(service/runtime.py, service/settings.py):

- Provider: with `VITSERVE_PROVIDER=auto` (the default) the session asks for `CUDAExecutionProvider`
  when onnxruntime offers it, then the CPU provider; `cuda` makes start-up fail rather than fall back.
  The provider really in use is reported by `GET /models` and the `vitserve_model_info` metric.
- Provider options: `device_id` (`VITSERVE_CUDA_DEVICE_ID`), `cudnn_conv_algo_search=HEURISTIC`
  (`VITSERVE_CUDNN_CONV_ALGO_SEARCH`; EXHAUSTIVE would benchmark the patch-embedding convolution's
  algorithms again for every new input shape, stalling the first batch of each size), and
  `gpu_mem_limit` when `VITSERVE_CUDA_MEM_LIMIT_BYTES` is set.
- Shapes repeat: warm-up runs every batch size from 1 to `VITSERVE_MAX_BATCH_SIZE` (and 1 to
  `VITSERVE_ATTENTION_MAX_BATCH_SIZE` for the attention graph), so no request ever meets a shape the
  session has not seen. Bucketing batch sizes (padding a batch to 1, 2, 4, ... 32) would cut warm-up
  to 6 sizes at the price of computing padding rows; not implemented, not measured.
- I/O binding: not used. Each batch is copied host to device and the logits back; for this model the
  input is 3 KiB per image and the logits 40 bytes per image, so binding would save little; it would
  matter for the attention graph's output (about 230 KiB per image) if maps were kept on the device.
  Not measured.

To measure it on a machine with an NVIDIA GPU and `onnxruntime-gpu`: `VITSERVE_PROVIDER=cuda python -m bench`
(the service cases then run on the GPU; the engine comparison stays on the CPU).
"""


def render(results: dict) -> str:
    meta = results.get("meta", {})
    engine, micro, service = results.get("engine"), results.get("micro"), results.get("service")
    out = ["# Benchmarks", ""]
    banners = []
    if meta.get("quick"):
        banners.append(
            "**SMOKE RUN (`--quick`): a few seconds per point, one concurrency level, one repeat. "
            "These numbers test the benchmark code; they are not results.**"
        )
    busy_runs = (service or {}).get("busy_runs", 0)
    if busy_runs or meta.get("busy_at_start", {}).get("busy"):
        banners.append(
            f"**WARNING: THE MACHINE WAS BUSY.** {busy_runs} of "
            f"{len((service or {}).get('points', []))} load runs started while other processes "
            "used the CPUs (see the busy-runs column); at the start: "
            f"{meta.get('busy_at_start', {}).get('describe', 'not checked')}. Numbers from a busy "
            "machine are not results: rerun on a quiet machine."
        )
    if (service or {}).get("skipped_runs"):
        banners.append(
            f"**{service['skipped_runs']} load runs were skipped** (the service benchmark ran past "
            f"its time budget of {service.get('budget_s', 0):.0f} s); the points they belonged to "
            "have fewer repeats (see the spreads)."
        )
    for name, error in meta.get("failures", {}).items():
        banners.append(f"**{name} FAILED:** `{error}`")
    for banner in banners:
        out += [f"> {banner}", ""]
    machine = meta.get("machine", {})
    versions = meta.get("versions", {})
    how_long = (
        "a smoke run, about 2 minutes" if meta.get("quick") else "about 14 minutes on 2 cores"
    )
    out += [
        f"Regenerate this file ({how_long}; `python -m bench` for the full run; stop anything else "
        "first, the run checks and reports when the machine is busy):",
        "",
        "```sh",
        meta.get("command", "python -m bench"),
        "```",
        "",
        f"Run {meta.get('started', '?')} to {meta.get('finished', '?')} "
        f"({meta.get('seconds', 0) / 60:.1f} min), git {meta.get('git', '?')}. Raw results: "
        f"`{meta.get('results_dir', '?')}` (JSON, every hey run with its command line).",
        "",
        "## Machine",
        "",
        table(
            ["", ""],
            [
                [
                    "CPU",
                    f"{machine.get('cpu_model')} ({machine.get('logical_cpus')} logical CPUs, "
                    f"{machine.get('usable_cpus')} usable)",
                ],
                ["memory", f"{machine.get('memory_gib', 0):.1f} GiB"],
                ["OS", f"{machine.get('os')}, kernel {machine.get('kernel')}"],
                ["versions", ", ".join(f"{k} {v}" for k, v in versions.items())],
                ["niceness of the run", machine.get("niceness")],
            ],
        ),
        "",
        "## Targets (issue 5)",
        "",
        table(
            ["target", "measured", "verdict"],
            [
                [
                    r["target"],
                    r["measured"],
                    r["verdict"] + (" (busy machine: not a result)" if r["busy"] else ""),
                ]
                for r in targets(engine, service)
            ],
        ),
        "",
    ]
    rows = findings(engine, micro, service)
    if rows:
        out += [
            "## Tuning: each option against what the service does now",
            "",
            "Measured in this run, side by side (details in the sections below). A ratio above 1 "
            "means the option is faster than the service's current setting.",
            "",
            table(["option", "with the option", "service now", "ratio", "measured how"], rows),
            "",
        ]
    if service:
        startup = service.get("startup_s", {})
        memory = service.get("memory_kib", {})
        idle = service.get("idle_memory_kib", {})
        out += [
            "## Start-up and memory",
            "",
            "Start-up: from spawning the process to the first 200 from `/health/ready` (the service "
            "loads both graphs and warms every batch size first; the rest is Python start-up and "
            "imports). Memory: VmRSS / VmHWM from "
            "/proc/PID/status, when ready and after the whole sweep.",
            "",
            table(
                [
                    "server",
                    "start-up s",
                    "of which load + warm-up s",
                    "RSS ready MiB",
                    "RSS after load MiB",
                    "peak (VmHWM) MiB",
                ],
                [
                    [
                        key,
                        fmt_spread(startup.get(key), 2),
                        _breakdown(service.get("startup_breakdown", {}).get(key)),
                        _mib(idle.get(key, {}).get("VmRSS")),
                        _mib(memory.get(key, {}).get("VmRSS")),
                        _mib(memory.get(key, {}).get("VmHWM")),
                    ]
                    for key in startup
                ],
            ),
            "",
            "## In-process ceiling",
            "",
            "Base64-decode, decode and preprocess 32 PNG images with the service's Preprocessor, "
            "stack, run the classifier with the service's Runtime (same session options): "
            f"**{fmt_spread(service.get('ceiling_images_per_s'))} images/s**, measured once per "
            "repeat, between the load runs.",
            "",
        ]
        out += service_section(service)
        out += variants_section(service)
    if engine:
        out += engine_section(engine)
    if micro:
        out += micro_section(micro)
    out += [CUDA_SECTION, "## How it was measured", ""]
    out += [f"- {line}" for line in meta.get("commands", [])]
    out += [
        "- Busy check: before every load run, /proc/stat and every /proc/PID/stat are sampled over "
        "1 s; a run is flagged when processes other than our (idle) servers used more than "
        "0.25 cores.",
        "- hey's percentiles are over every answered request including non-200 answers; its "
        "Requests/sec counts errors too, so req/s here is recomputed from the 200 count and hey's "
        "total time.",
        "",
    ]
    return "\n".join(out) + "\n"


def _shorten(command: str) -> str:
    """A command line with the run's temporary paths reduced to their file names."""
    parts = command.split()
    return " ".join(
        Path(p).name if p.startswith("/") and ("vitserve-bench-" in p or p.endswith(".json")) else p
        for p in parts
    )


def _breakdown(samples: list[dict] | None) -> str:
    """Median load and warm-up seconds from the service's own start-up log line."""
    if not samples:
        return "-"
    load = sorted(sample["load_s"] for sample in samples)[len(samples) // 2]
    warm = sorted(sample["warmup_s"] for sample in samples)[len(samples) // 2]
    return f"{load:.2f} + {warm:.2f}"


def _mib(kib: int | None) -> str:
    return f"{kib / 1024:.0f}" if kib else "-"


def load(directory: Path) -> dict:
    results = {}
    for name in ("meta", "engine", "micro", "service"):
        path = directory / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", type=Path, help="a results directory written by python -m bench")
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    args = parser.parse_args(argv)
    args.output.write_text(render(load(args.results)))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
