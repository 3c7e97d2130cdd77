"""Slow clients against ``python -m service`` with its default deadlines (the target: half-sent
headers closed within 60 s; a body trickled at a byte per 10 s cut off)::

    python -m tests.reliability.slow_clients_at_defaults

Three connections at once: headers that never finish, a body trickled at a byte per 10 s, and a
body sent at 20 kB/s for 40 s (faster than body_min_bytes_per_s, so never cut off). Prints, for
each, how long the server kept it open and the status line it answered with.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from tests.reliability.json_bombs import served


def _head(length: int) -> bytes:
    return (
        "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _hold(address: tuple[str, int], first: bytes, then: bytes, every_s: float) -> dict[str, Any]:
    """Send ``first``, then ``then`` every ``every_s`` seconds until the server answers or closes."""
    sock = socket.create_connection(address, timeout=5)
    started = time.monotonic()
    sock.sendall(first)
    answer = b""
    sock.settimeout(every_s)
    while time.monotonic() - started < 300:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if then:
                try:
                    sock.sendall(then)
                except OSError:
                    break
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    sock.close()
    return {
        "open_s": round(time.monotonic() - started, 1),
        "answer": answer.split(b"\r\n", 1)[0].decode("latin-1"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-repository", default="models")
    args = parser.parse_args(argv)
    steady = json.dumps({"images": [{"pixels": [[0] * 28] * 28}]}).encode()
    steady += b" " * (800_000 - len(steady))
    with served(args.model_repository) as (url, _):
        parts = urlsplit(url)
        address = (parts.hostname or "127.0.0.1", parts.port or 80)
        cases = {
            "headers never finished": (b"POST /predict HTTP/1.1\r\nHost: x\r\n", b"", 1.0),
            "body at a byte per 10 s": (_head(1000) + b"{", b" ", 10.0),
        }
        with ThreadPoolExecutor(3) as pool:
            futures = {name: pool.submit(_hold, address, *case) for name, case in cases.items()}
            futures["body at 20 kB/s for 40 s"] = pool.submit(_steady, address, steady)
            results = {name: future.result() for name, future in futures.items()}
    print(json.dumps(results, indent=2))
    return 0


def _steady(address: tuple[str, int], body: bytes) -> dict[str, Any]:
    sock = socket.create_connection(address, timeout=30)
    started = time.monotonic()
    sock.sendall(_head(len(body)))
    for offset in range(0, len(body), 2000):
        sock.sendall(body[offset : offset + 2000])
        time.sleep(0.1)
    answer = sock.recv(65536)
    sock.close()
    return {
        "open_s": round(time.monotonic() - started, 1),
        "answer": answer.split(b"\r\n", 1)[0].decode("latin-1"),
    }


if __name__ == "__main__":
    sys.exit(main())
