"""Soak: minutes of steady mixed traffic against a real service, with a bound on memory growth.

    nice -n 10 python -m bench.reliability.soak --seconds 180 --clients 4 \\
        --out bench/results/reliability-soak.json

Starts ``python -m service`` (the shipped model unless --repository/--model say otherwise), learns each
image's answer while it is quiet, then ``--clients`` connections send, for ``--seconds`` (at most
``--max-requests``), a steady mix with ``--pause`` seconds between requests: /predict as JSON base64,
as multipart and as pixels, /attention as JSON and as PNG, and bad input of ten kinds, each with its
expected 4xx. Resident memory is sampled every ``--sample`` seconds.

Memory growth is the largest RSS of the last third of the run minus the RSS at the end of the warm-up
(the first sixth). Exits 1 when an answer was wrong, a status was not the expected one, or the growth
is over ``--max-growth-mib``.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from bench.reliability.common import Payloads, b64, bad_requests, dump, percentile, service

MiB = 2**20


def one_request(http: httpx.Client, payloads: Payloads, rng: random.Random, bad: list) -> tuple:
    """Send one request of a random kind: (kind, status, expected status, answer right)."""
    index = rng.randrange(len(payloads.pngs))
    roll = rng.random()
    if roll < 0.30:
        response = http.post("/predict", json=payloads.json_body(index))
        kind = "predict json"
    elif roll < 0.45:
        files = [("files", ("garment.png", payloads.pngs[index], "image/png"))]
        response = http.post("/predict", files=files, data={"top_k": "3"})
        kind = "predict multipart"
    elif roll < 0.55:
        response = http.post(
            "/predict", json={"images": [{"pixels": payloads.images[index].tolist()}]}
        )
        kind = "predict pixels"
    elif roll < 0.65:
        response = http.post("/attention", json={"image": {"b64": b64(payloads.pngs[index])}})
        kind = "attention json"
    elif roll < 0.70:
        response = http.post(
            "/attention", json={"image": {"b64": b64(payloads.pngs[index])}, "format": "png"}
        )
        kind = "attention png"
    else:
        name, arguments, expected = bad[rng.randrange(len(bad))]
        response = http.post("/predict", **arguments)
        return f"bad: {name}", response.status_code, expected, response.status_code == expected
    right = response.status_code == 200
    if right and kind.startswith("predict"):
        right = response.json()["predictions"][0]["index"] == payloads.expected[index]
    elif right and kind == "attention json":
        right = response.json()["prediction"]["index"] == payloads.expected[index]
    elif right and kind == "attention png":
        right = response.content.startswith(b"\x89PNG")
    return kind, response.status_code, 200, right


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument(
        "--pause", type=float, default=0.01, help="seconds between a client's requests"
    )
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--sample", type=float, default=1.0, help="seconds between RSS samples")
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    parser.add_argument("--repository", default="models")
    parser.add_argument("--model", default="fashion-mnist-vit")
    parser.add_argument("--log", type=Path, default=Path("bench/results/reliability-soak.log"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    payloads = Payloads.load(16)
    bad = bad_requests()
    settings = {"model_repository": args.repository, "model_name": args.model}
    counts: Counter = Counter()
    latencies: dict[str, list[float]] = defaultdict(list)
    problems: list[str] = []
    samples: list[tuple[float, int]] = []
    lock = threading.Lock()
    sent = 0

    with service(args.log, **settings) as running:
        payloads.learn_answers(running.url)
        started = time.monotonic()
        deadline = started + args.seconds

        def client(seed: int) -> None:
            nonlocal sent
            rng = random.Random(seed)
            with httpx.Client(base_url=running.url, timeout=60) as http:
                while time.monotonic() < deadline:
                    with lock:
                        if sent >= args.max_requests:
                            return
                        sent += 1
                    began = time.perf_counter()
                    try:
                        kind, status, expected, right = one_request(http, payloads, rng, bad)
                    except httpx.TransportError as error:
                        with lock:
                            problems.append(f"transport error {error!r}")
                        continue
                    took = time.perf_counter() - began
                    with lock:
                        counts[(kind, status)] += 1
                        latencies[kind].append(took)
                        if status != expected or not right:
                            problems.append(f"{kind}: status {status}, expected {expected}")
                    time.sleep(args.pause)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            samples.append((time.monotonic() - started, running.status("VmRSS")))
            time.sleep(args.sample)
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        peak = running.status("VmHWM")
        process = running.process

    warm = [rss for t, rss in samples if t <= elapsed / 6] or [samples[0][1]]
    last = [rss for t, rss in samples if t >= elapsed * 2 / 3] or [samples[-1][1]]
    growth = (max(last) - warm[-1]) / MiB
    total = sum(counts.values())
    result = {
        "settings": settings,
        "images": payloads.source,
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "requests": total,
        "per_second": round(total / elapsed, 1),
        "by_kind_and_status": {f"{k} -> {s}": n for (k, s), n in sorted(counts.items())},
        "latency_ms": {
            kind: {
                "p50": round(percentile(values, 50) * 1000, 2),
                "p99": round(percentile(values, 99) * 1000, 2),
            }
            for kind, values in sorted(latencies.items())
        },
        "problems": problems[:20],
        "problem_count": len(problems),
        "rss_mib_after_warmup": round(warm[-1] / MiB, 1),
        "rss_mib_max_last_third": round(max(last) / MiB, 1),
        "rss_mib_end": round(samples[-1][1] / MiB, 1),
        "peak_rss_mib": round(peak / MiB, 1),
        "growth_mib": round(growth, 1),
        "max_growth_mib": args.max_growth_mib,
        "rss_samples": len(samples),
        "exit_code_after_sigterm": process.returncode,
    }
    result["held"] = (
        not problems and growth <= args.max_growth_mib and process.returncode == 0 and total > 0
    )
    dump(result, args.out)
    return 0 if result["held"] else 1


if __name__ == "__main__":
    sys.exit(main())
