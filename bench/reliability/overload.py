"""Overload: drive a real service well past capacity for a bounded time, then check that it recovers.

    nice -n 10 python -m bench.reliability.overload --seconds 20 --clients 64 \\
        --out bench/results/reliability-overload.json

Starts ``python -m service`` (the shipped model unless --repository/--model say otherwise) with a small
queue, learns each image's answer while the service is quiet, then runs three bounded phases:

1. flood: ``--clients`` connections send 1-4-image /predict requests back to back for ``--seconds``
   (at most ``--max-requests``): accepted vs refused counts, latency of each, Retry-After on every 503,
   every accepted answer checked against the quiet one;
2. large images: ``--bomb-clients`` connections send PNGs of 4096 x 4096 RGBA pixels (about 65 kB each,
   the default pixel limit) for ``--bomb-seconds``: what decoding does to memory;
3. recovery: readiness, an empty queue, and sequential requests whose latency is compared with the
   quiet service's.

Peak RSS (VmHWM) is read from /proc after each phase. Exits 1 when a promise broke: a 5xx other than
503, a refusal without Retry-After, a wrong answer, or no recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
from pathlib import Path

import httpx
from PIL import Image

from bench.reliability.common import Payloads, b64, dump, percentile, service

MiB = 2**20


async def flood(url: str, payloads: Payloads, clients: int, seconds: float, limit: int) -> dict:
    deadline = time.monotonic() + seconds
    sent = 0
    outcomes: dict[str, list[float]] = {"accepted": [], "refused": [], "other": []}
    problems: list[str] = []

    async def client(number: int) -> None:
        nonlocal sent
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            count = 0
            while time.monotonic() < deadline and sent < limit:
                sent += 1
                count += 1
                size = 1 + (number + count) % 4
                indices = [(number * 7 + count + i) % len(payloads.pngs) for i in range(size)]
                body = {"images": [{"b64": b64(payloads.pngs[i])} for i in indices]}
                started = time.perf_counter()
                try:
                    response = await http.post("/predict", json=body)
                except httpx.TransportError as error:
                    outcomes["other"].append(time.perf_counter() - started)
                    problems.append(f"transport error: {error!r}")
                    continue
                took = time.perf_counter() - started
                if response.status_code == 200:
                    outcomes["accepted"].append(took)
                    got = [p["index"] for p in response.json()["predictions"]]
                    if got != [payloads.expected[i] for i in indices]:
                        problems.append(f"wrong answer {got} for images {indices}")
                elif response.status_code == 503:
                    outcomes["refused"].append(took)
                    if "retry-after" not in response.headers:
                        problems.append("503 without Retry-After")
                else:
                    outcomes["other"].append(took)
                    problems.append(f"status {response.status_code}: {response.text[:200]}")

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.monotonic() - started
    summary = {
        "requests": sum(len(v) for v in outcomes.values()),
        "seconds": round(elapsed, 2),
        "problems": problems[:20],
        "problem_count": len(problems),
    }
    for name, latencies in outcomes.items():
        summary[name] = {
            "count": len(latencies),
            "per_second": round(len(latencies) / elapsed, 1),
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
            "max_ms": _ms(max(latencies) if latencies else None),
        }
    return summary


async def large_images(url: str, clients: int, seconds: float) -> dict:
    buffer = io.BytesIO()
    Image.new("RGBA", (4096, 4096), (12, 12, 12, 255)).save(buffer, format="PNG")
    body = {"images": [{"b64": b64(buffer.getvalue())}]}
    deadline = time.monotonic() + seconds
    statuses: dict[int, int] = {}
    latencies: list[float] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            for _ in range(1000):
                if time.monotonic() > deadline:
                    break
                started = time.perf_counter()
                response = await http.post("/predict", json=body)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return {
        "png_bytes": len(buffer.getvalue()),
        "statuses": {str(k): v for k, v in statuses.items()},
        "p50_ms": _ms(percentile(latencies, 50)),
        "max_ms": _ms(max(latencies) if latencies else None),
    }


def recovery(url: str, payloads: Payloads, quiet_ms: float) -> dict:
    with httpx.Client(base_url=url, timeout=60) as http:
        ready = http.get("/health/ready").status_code == 200
        metrics = http.get("/metrics").text
        depth = [line for line in metrics.splitlines() if line.startswith("vitserve_queue_depth{")]
        latencies, wrong = [], 0
        for index in range(len(payloads.pngs)):
            started = time.perf_counter()
            response = http.post("/predict", json=payloads.json_body(index))
            latencies.append(time.perf_counter() - started)
            if (
                response.status_code != 200
                or response.json()["predictions"][0]["index"] != payloads.expected[index]
            ):
                wrong += 1
    after_ms = statistics.median(latencies) * 1000
    return {
        "ready": ready,
        "queue_depth": depth,
        "requests": len(latencies),
        "failed_or_wrong": wrong,
        "p50_ms_quiet_before": round(quiet_ms, 2),
        "p50_ms_after": round(after_ms, 2),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def quiet_latency(url: str, payloads: Payloads) -> float:
    with httpx.Client(base_url=url, timeout=60) as http:
        times = []
        for index in range(len(payloads.pngs)):
            started = time.perf_counter()
            http.post("/predict", json=payloads.json_body(index)).raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="flood duration")
    parser.add_argument("--clients", type=int, default=64, help="concurrent connections")
    parser.add_argument("--max-requests", type=int, default=50_000, help="flood request cap")
    parser.add_argument("--bomb-seconds", type=float, default=10.0)
    parser.add_argument("--bomb-clients", type=int, default=8)
    parser.add_argument("--queue-size", type=int, default=16, help="VITSERVE_MAX_QUEUE_SIZE")
    parser.add_argument("--repository", default="models", help="VITSERVE_MODEL_REPOSITORY")
    parser.add_argument("--model", default="fashion-mnist-vit", help="VITSERVE_MODEL_NAME")
    parser.add_argument("--log", type=Path, default=Path("bench/results/reliability-overload.log"))
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    payloads = Payloads.load(16)
    settings = {
        "model_repository": args.repository,
        "model_name": args.model,
        "max_queue_size": args.queue_size,
        "max_images_per_request": 4,
        "max_batch_size": 8,
        "retry_after_s": 1,
    }
    result: dict = {"settings": settings, "images": payloads.source, "clients": args.clients}
    with service(args.log, **settings) as running:
        payloads.learn_answers(running.url)
        quiet_ms = quiet_latency(running.url, payloads)
        result["rss_mib_quiet"] = round(running.status("VmRSS") / MiB, 1)
        result["flood"] = asyncio.run(
            flood(running.url, payloads, args.clients, args.seconds, args.max_requests)
        )
        result["peak_rss_mib_after_flood"] = round(running.status("VmHWM") / MiB, 1)
        result["large_images"] = asyncio.run(
            large_images(running.url, args.bomb_clients, args.bomb_seconds)
        )
        result["peak_rss_mib_after_large_images"] = round(running.status("VmHWM") / MiB, 1)
        result["recovery"] = recovery(running.url, payloads, quiet_ms)
        result["rss_mib_end"] = round(running.status("VmRSS") / MiB, 1)
        process = running.process
    result["exit_code_after_sigterm"] = process.returncode
    flood_result, back = result["flood"], result["recovery"]
    held = (
        flood_result["problem_count"] == 0
        and flood_result["refused"]["count"] > 0
        and back["ready"]
        and back["failed_or_wrong"] == 0
        and set(result["large_images"]["statuses"]) <= {"200", "503"}
        and process.returncode == 0
    )
    result["held"] = held
    dump(result, args.out)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
