"""Header bombs: connections sending endless request headers to /health/live at once.

    nice -n 10 python -m bench.reliability.header_bombs --connections 4 --mib 200

Starts ``python -m service`` (the shipped model, default header limits), then each connection sends a
request line and one header whose value never ends, up to ``--mib`` MiB, until the server answers and
closes. Reports each answer's status, the bytes each got to send, and the server's RSS before and at
its peak (VmHWM). Before the bounds, four such connections got 200 and RSS went from 162 to 2,360 MiB.
Loopback only; each connection stops at its byte cap or when the server closes it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
from pathlib import Path

from bench.reliability.common import dump, service

MiB = 2**20


def bomb(port: int, most: int, results: list[dict]) -> None:
    sent, status = 0, None
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        chunk = b"a" * 65536
        try:
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Bomb: ")
            while sent < most:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        try:
            status = int(sock.recv(65536).split(b" ", 2)[1])
        except (OSError, IndexError, ValueError):
            status = None
    results.append({"status": status, "sent_mib": sent / MiB})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--mib", type=int, default=200, help="most header bytes each sends")
    parser.add_argument(
        "--log", type=Path, default=Path("bench/results/reliability-header-bombs.log")
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with service(args.log) as server:
        port = int(server.url.rsplit(":", 1)[1])
        before = server.status("VmRSS")
        threads = [
            threading.Thread(target=bomb, args=(port, args.mib * MiB, results))
            for _ in range(args.connections)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        peak = server.status("VmHWM")
    result = {
        "answers": results,
        "rss_before_mib": before / MiB,
        "rss_peak_mib": peak / MiB,
        "rss_growth_mib": (peak - before) / MiB,
    }
    dump(result, args.out)
    return 0 if all(r["status"] == 431 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
