"""bench/one_client.py against a local server that takes a known time: every answer counted by its
status, each latency at least that time and kept to the microsecond, a dropped connection counted as
an error and opened again, and hey's percentile rule."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from bench import one_client

DELAY_S = 0.00237  # not a multiple of hey's 0.1 ms steps


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects
    disable_nagle_algorithm = True  # headers and body go out in two writes
    served = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        Handler.served += 1
        if Handler.served % 5 == 0:  # every fifth request: the connection dropped, no answer
            self.close_connection = True
            return
        time.sleep(DELAY_S)
        status = 200 if Handler.served % 7 else 503
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A local server of ``handler`` in a thread: its /predict URL, until the fixture ends."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/predict"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server() -> Iterator[str]:
    Handler.served = 0
    yield from serving(Handler)


def test_each_request_is_timed_and_counted(server):
    began = time.monotonic()
    result = one_client.run(server, b'{"images": []}', seconds=1.0)
    assert time.monotonic() - began < 3  # it stops when its time is up
    answered = sum(result.status_codes.values())
    # counts, not a rate: enough requests for a 503 (every 7th) and a dropped connection (every 5th)
    # on a loaded machine too (18 in half a second under a full test run beside benchmarks)
    assert answered >= 8
    assert Handler.served == answered + result.error_count  # one request at a time, none lost
    assert result.error_count == Handler.served // 5 and set(result.errors) == {
        "RemoteDisconnected"
    }
    assert result.status_codes[503] >= 1 and result.ok == result.status_codes[200]
    p50 = result.percentiles_s[50]
    assert DELAY_S <= p50 < 0.25  # a request's own time, in seconds: not the run's, nor in ms
    assert round(p50 * 1e4) != p50 * 1e4  # not rounded to hey's 0.1 ms
    assert result.ok_rps == pytest.approx(result.ok / result.total_s)


class Slow(Handler):
    """Answers every request, in three times the delay."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(3 * DELAY_S)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.fixture
def slow_server() -> Iterator[str]:
    yield from serving(Slow)


def test_servers_in_turn_each_get_their_slices_and_their_own_times(server, slow_server):
    turns: list[tuple[int, bool]] = []
    fast, slow = one_client.alternate(
        [(server, b"{}"), (slow_server, b"{}")],
        seconds=0.8,
        slice_s=0.1,
        on_turn=lambda index, starting: turns.append((index, starting)),
    )
    # each turn is announced as it starts and as it ends, the servers in order
    assert len(turns) >= 8 and turns[:4] == [(0, True), (0, False), (1, True), (1, False)]
    assert turns == [(i % 4 // 2, i % 2 == 0) for i in range(len(turns))]
    # each server's requests timed apart (not bounded above: a loaded machine adds its own time)
    assert DELAY_S <= fast.percentiles_s[50] < slow.percentiles_s[50]
    assert slow.percentiles_s[50] >= 3 * DELAY_S
    # turns of equal time: each server's requests took about half of it, the fast one's more of them
    assert fast.total_s == pytest.approx(slow.total_s, abs=0.1) and 0.25 < slow.total_s < 0.6
    assert sum(fast.status_codes.values()) > sum(slow.status_codes.values()) >= 3
    # each server's time is its own requests' time: its req/s is one over its mean latency
    assert slow.rps == pytest.approx(1 / slow.average_s, rel=1e-6)


def test_percentiles_follow_heys_rule():
    ordered = [float(i) for i in range(1, 11)]  # 1..10
    assert one_client.percentile(ordered, 50) == 6.0  # index 10 * 50 // 100 = 5
    assert one_client.percentile(ordered, 99) == 10.0
    assert one_client.percentile(ordered, 10) == 2.0
