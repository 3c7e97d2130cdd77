"""What one process hop costs: the round trip of a small message between two processes.

``python -m bench.link_rtt [--trips 3000] [--size 200] [--gap-ms 0]`` echoes ``--size`` bytes
``--trips`` times (after 200 warm-up trips) between this process and a child, both on uvloop, through:

- ``zmq.asyncio``: pyzmq's asyncio sockets, DEALER to ROUTER over ipc, as ``service/link`` first used
  them;
- ``zmq fd``: plain pyzmq sockets read from the event loop through their file descriptor, as
  ``service/link`` used them next;
- ``link``: the service's own link (``service/link/wire.py``: a Unix socket, ``wire.Link`` at both
  ends, each message packed and unpacked as the service does: a call's typed header, its rows as a raw
  frame).

``--gap-ms`` waits that long, idle, before each trip, as a lone client leaves both processes idle
between its requests: an idle core takes longer to wake, and ZeroMQ wakes two more threads per trip.
It prints each one's p50 and p90 in microseconds. BENCHMARKS.md ("The link without ZeroMQ") quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import time
from collections.abc import Awaitable, Callable

import uvloop
import zmq
import zmq.asyncio

from service.link import protocol, wire

WARM_UP = 200
KINDS = ("zmq.asyncio", "zmq fd", "link")


def _drain(sock: zmq.Socket, on_message: Callable[[list[bytes]], None]) -> None:
    """Everything readable now: the descriptor is edge-triggered."""
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        on_message(sock.recv_multipart(zmq.NOBLOCK))


def _echo(kind: str, address: str, ready: multiprocessing.synchronize.Event) -> None:
    async def main() -> None:
        if kind == "link":

            def echo(link: wire.Link, items: list[wire.Item]) -> None:
                for message, raw in items:
                    link.outbox.put(message, *raw, at_once=True)

            server = await asyncio.get_running_loop().create_unix_server(
                lambda: wire.Link(wire.to_engine, echo), address
            )
            ready.set()
            await server.serve_forever()
        elif kind == "zmq.asyncio":
            sock = zmq.asyncio.Context().socket(zmq.ROUTER)
            sock.bind(f"ipc://{address}")
            ready.set()
            while True:
                sock.send_multipart(await sock.recv_multipart())
        else:
            sock = zmq.Context().socket(zmq.ROUTER)
            sock.bind(f"ipc://{address}")
            reply = lambda message: sock.send_multipart(message, zmq.NOBLOCK)  # noqa: E731
            asyncio.get_running_loop().add_reader(sock.FD, _drain, sock, reply)
            ready.set()
            await asyncio.Event().wait()

    uvloop.run(main())


async def _client(kind: str, address: str, size: int) -> Callable[[], Awaitable[object]]:
    """One round trip, as a coroutine function returning the bytes echoed."""
    payload = b"x" * size
    loop = asyncio.get_running_loop()
    if kind == "link":
        echoed: list[asyncio.Future] = []

        def answer(_: wire.Link, items: list[wire.Item]) -> None:
            for _message, raw in items:
                echoed.pop().set_result(bytes(raw[0]))

        _, link = await loop.create_unix_connection(
            lambda: wire.Link(wire.to_engine, answer), address
        )
        call = protocol.Infer(
            1, "model", 1, None, 0, "classifier", (1, size), "|u1", None, "request-id"
        )

        async def trip() -> object:
            echoed.append(loop.create_future())
            future = echoed[-1]
            link.outbox.put(call, payload, at_once=True)
            return await future

        return trip
    if kind == "zmq.asyncio":
        sock = zmq.asyncio.Context().socket(zmq.DEALER)
        sock.connect(f"ipc://{address}")

        async def trip() -> object:
            await sock.send(payload)
            return await sock.recv()

        return trip
    plain = zmq.Context().socket(zmq.DEALER)
    plain.connect(f"ipc://{address}")
    waiting: list[asyncio.Future] = []
    answer = lambda message: waiting.pop().set_result(message[-1])  # noqa: E731
    loop.add_reader(plain.FD, _drain, plain, answer)

    async def trip() -> object:
        waiting.append(loop.create_future())
        future = waiting[-1]
        plain.send(payload, zmq.NOBLOCK)
        loop.call_soon(_drain, plain, answer)  # a send can leave the descriptor's edge unseen
        return await future

    return trip


def round_trips(kind: str, trips: int, size: int, gap_s: float = 0.0) -> list[float]:
    """Each round trip's seconds, sorted."""
    with tempfile.TemporaryDirectory() as directory:
        address = os.path.join(directory, "link")
        ready = multiprocessing.get_context("spawn").Event()
        child = multiprocessing.get_context("spawn").Process(
            target=_echo, args=(kind, address, ready), daemon=True
        )
        child.start()
        try:
            if not ready.wait(30):
                raise RuntimeError(f"the {kind} echo process did not start")

            async def measure() -> list[float]:
                trip = await _client(kind, address, size)
                for _ in range(WARM_UP):
                    if await trip() != b"x" * size:
                        raise RuntimeError(f"the {kind} link did not echo what it was sent")
                seconds = []
                for _ in range(trips):
                    if gap_s:
                        time.sleep(gap_s)  # idle, not polling: as between a lone client's requests
                    started = time.perf_counter()
                    await trip()
                    seconds.append(time.perf_counter() - started)
                return sorted(seconds)

            return uvloop.run(measure())
        finally:
            child.terminate()
            child.join(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=3000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each trip")
    args = parser.parse_args(argv)
    for kind in KINDS:
        seconds = round_trips(kind, args.trips, args.size, args.gap_ms / 1000)
        p50, p90 = seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.9)]
        print(
            f"{kind:12} p50 {p50 * 1e6:6.1f} us  p90 {p90 * 1e6:6.1f} us  ({args.trips} trips"
            f"{f', {args.gap_ms:g} ms idle before each' if args.gap_ms else ''})"
        )


if __name__ == "__main__":
    main()
