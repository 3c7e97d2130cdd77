"""What one process hop costs: the round trip of a small message between two processes.

``python -m bench.link_rtt [--trips 3000] [--size 200]`` echoes ``--size`` bytes ``--trips`` times
(after 200 warm-up trips) between this process and a child, both on uvloop, through:

- ``zmq.asyncio``: pyzmq's asyncio sockets, DEALER to ROUTER over ipc, as ``service/link`` used them;
- ``zmq fd``: plain pyzmq sockets read from the event loop through their file descriptor, as
  ``service/link``'s ``wire.LoopSocket`` reads them now;
- ``unix``: a Unix socket with asyncio streams, no messaging library.

It prints each one's p50 and p90 in microseconds. BENCHMARKS.md ("The process hop") quotes it.
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

WARM_UP = 200


def _drain(sock: zmq.Socket, on_message: Callable[[list[bytes]], None]) -> None:
    """Everything readable now: the descriptor is edge-triggered."""
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        on_message(sock.recv_multipart(zmq.NOBLOCK))


def _echo(kind: str, address: str, ready: multiprocessing.synchronize.Event) -> None:
    async def main() -> None:
        if kind == "unix":

            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while True:
                    writer.write(
                        await reader.readexactly(int.from_bytes(await reader.readexactly(4)))
                    )

            server = await asyncio.start_unix_server(echo, address)
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
    if kind == "unix":
        reader, writer = await asyncio.open_unix_connection(address)

        async def trip() -> object:
            writer.write(size.to_bytes(4) + payload)
            return await reader.readexactly(size)

        return trip
    if kind == "zmq.asyncio":
        sock = zmq.asyncio.Context().socket(zmq.DEALER)
        sock.connect(f"ipc://{address}")

        async def trip() -> object:
            await sock.send(payload)
            return await sock.recv()

        return trip
    loop = asyncio.get_running_loop()
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


def round_trips(kind: str, trips: int, size: int) -> list[float]:
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
    args = parser.parse_args(argv)
    for kind in ("zmq.asyncio", "zmq fd", "unix"):
        seconds = round_trips(kind, args.trips, args.size)
        p50, p90 = seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.9)]
        print(f"{kind:12} p50 {p50 * 1e6:6.1f} us  p90 {p90 * 1e6:6.1f} us  ({args.trips} trips)")


if __name__ == "__main__":
    main()
