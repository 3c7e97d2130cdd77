"""One client, one request at a time, each timed to the microsecond: the c=1 points of bench/compare.py.

hey prints latencies to 0.1 ms, 3% of a 3 ms request, so two of its steps span the c=1 target
(p50 within 5% of the plain server's). And on a shared machine the speed drifts by more than that
from one 12 s run to the next (the 13:37 run: the plain server's c=1 p50 was 3.37, 2.68 and 2.40 ms
in its three rounds). So :func:`alternate` sends to several servers in turn, half a second each,
over one keep-alive connection per server (``http.client``, as hey keeps its connections): within a
turn a server's requests come back to back, as at c=1, and the drift falls on every server alike.
Each request is timed from its write to the last byte of its answer (``perf_counter_ns``). A connection the server closes is opened again and
counted as an error, as hey counts one. Results come in hey's summary shape
(:class:`bench.hey.HeyResult`), ``total_s`` being the time spent in that server's own requests.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from bench.hey import HeyResult

PERCENTILES = (10, 25, 50, 75, 90, 95, 99)  # hey's
HEADERS = {"Content-Type": "application/json"}
# Each server's turn: long enough that its requests come back to back, as at c=1 (one request each
# in turn left each server idle for the others' ~20 ms and measured a colder request: the 14:08 run,
# stopped, had vitserve at 216 req/s where it answers about 300 alone), short against the drift.
SLICE_S = 0.5


def percentile(ordered: list[float], p: int) -> float:
    """hey's percentile of sorted ``ordered``: the value at index ``len * p / 100``."""
    return ordered[min(len(ordered) - 1, len(ordered) * p // 100)]


class _Client:
    """One server's connection and what its requests took."""

    def __init__(self, url: str, body: bytes, timeout_s: float) -> None:
        self.parts, self.body, self.timeout_s = urlsplit(url), body, timeout_s
        self.connection = self._connect()
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.spent_ns = 0

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(
            self.parts.hostname, self.parts.port, timeout=self.timeout_s
        )

    def send(self) -> None:
        sent = time.perf_counter_ns()
        try:
            self.connection.request("POST", self.parts.path, self.body, HEADERS)
            answer = self.connection.getresponse()
            answer.read()
        except (OSError, http.client.HTTPException) as error:
            self.spent_ns += time.perf_counter_ns() - sent
            self.errors[type(error).__name__] = self.errors.get(type(error).__name__, 0) + 1
            self.connection.close()
            self.connection = self._connect()
            return
        took = time.perf_counter_ns() - sent
        self.spent_ns += took
        self.latencies.append(took / 1e9)
        self.statuses[answer.status] = self.statuses.get(answer.status, 0) + 1

    def result(self) -> HeyResult:
        self.connection.close()
        total = max(self.spent_ns / 1e9, 1e-9)
        ordered = sorted(self.latencies)
        return HeyResult(
            total,
            (len(self.latencies) + sum(self.errors.values())) / total,
            sum(ordered) / len(ordered) if ordered else None,
            {p: percentile(ordered, p) for p in PERCENTILES} if ordered else {},
            self.statuses,
            self.errors,
        )


def alternate(
    targets: Sequence[tuple[str, bytes]],
    seconds: float,
    slice_s: float = SLICE_S,
    timeout_s: float = 30.0,
    on_turn: Callable[[int, bool], None] | None = None,
) -> list[HeyResult]:
    """POST each target's body (JSON) to its URL, one request at a time, the targets in turn for
    ``slice_s`` each, for ``seconds`` in all; a result per target, in order. ``on_turn(index,
    starting)`` is called as each turn starts and ends (to read what a server used in its own)."""
    clients = [_Client(url, body, timeout_s) for url, body in targets]
    began = time.perf_counter()
    try:
        while time.perf_counter() - began < seconds:
            for index, client in enumerate(clients):
                if on_turn is not None:
                    on_turn(index, True)
                turn = time.perf_counter()
                while time.perf_counter() - turn < slice_s:
                    client.send()
                if on_turn is not None:
                    on_turn(index, False)
    finally:
        results = [client.result() for client in clients]
    return results


def run(url: str, body: bytes, seconds: float, timeout_s: float = 30.0) -> HeyResult:
    """One server alone: :func:`alternate` with one target."""
    return alternate([(url, body)], seconds, timeout_s=timeout_s)[0]
