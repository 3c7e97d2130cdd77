"""One client, one request at a time, each timed to the microsecond: the c=1 points of bench/compare.py.

hey prints latencies to 0.1 ms, 3% of a 3 ms request, so two of its steps span issue 23's c=1 target
(p50 within 5% of the plain server's). This sends the same POST back to back over one keep-alive
connection (``http.client``, as hey keeps its connections), times each from the write of its request
to the last byte of its answer with ``perf_counter_ns``, and reports what hey's summary reports
(:class:`bench.hey.HeyResult`), so that a c=1 point reads like any other. A connection the server
closes is opened again and counted as an error, as hey counts one.
"""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

from bench.hey import HeyResult

PERCENTILES = (10, 25, 50, 75, 90, 95, 99)  # hey's


def percentile(ordered: list[float], p: int) -> float:
    """hey's percentile of sorted ``ordered``: the value at index ``len * p / 100``."""
    return ordered[min(len(ordered) - 1, len(ordered) * p // 100)]


def run(url: str, body: bytes, seconds: float, timeout_s: float = 30.0) -> HeyResult:
    """POST ``body`` (JSON) to ``url`` one request at a time for ``seconds``."""
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors: dict[str, int] = {}
    began = time.perf_counter()
    try:
        while time.perf_counter() - began < seconds:
            sent = time.perf_counter_ns()
            try:
                connection.request("POST", parts.path, body, headers)
                answer = connection.getresponse()
                answer.read()
            except (OSError, http.client.HTTPException) as error:
                errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1
                connection.close()
                connection = http.client.HTTPConnection(
                    parts.hostname, parts.port, timeout=timeout_s
                )
                continue
            latencies.append((time.perf_counter_ns() - sent) / 1e9)
            statuses[answer.status] = statuses.get(answer.status, 0) + 1
    finally:
        connection.close()
    total = time.perf_counter() - began
    ordered = sorted(latencies)
    return HeyResult(
        total,
        (len(latencies) + sum(errors.values())) / total,
        sum(latencies) / len(latencies) if latencies else None,
        {p: percentile(ordered, p) for p in PERCENTILES} if ordered else {},
        statuses,
        errors,
    )
