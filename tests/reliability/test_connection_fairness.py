"""Every kept-alive connection is served in its turn: under a load that keeps the service saturated
(more connections than the front ends' and the engine's work in progress, each sending its next
request as soon as its last is answered, as wrk does), no connection is answered far less often than
the others. Counted, not timed: each connection's answers once the whole load has had a fixed number.

The seam issue's c=256 tail (p99 six times p50 under wrk, a third of that under hey) pointed at how
connections and their requests are shared between front ends, the queue's order and the engine's
grouping. Measured again with wrk, hey and this test's client on a quiet machine, the tail was not
there (BENCHMARKS.md, "What a request costs"); what this test holds is the order: a request order that
is not first come, first served (a stack, a front end served before the other, a connection parked
behind new ones) leaves some connections with a fraction of the others' answers."""

from __future__ import annotations

import asyncio
import json
import statistics

import numpy as np
import pytest

from tests.support import RELIABILITY, b64, encode, running_server

pytestmark = pytest.mark.slow  # one server, about 10 s

CONNECTIONS = 48
ANSWERS = 40 * CONNECTIONS


async def load(port: int, body: bytes) -> list[int]:
    """Each connection's answers (all 200) when the connections together have had ``ANSWERS``."""
    request = (
        b"POST /predict HTTP/1.1\r\nhost: vitserve\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    counts = [0] * CONNECTIONS
    done = asyncio.Event()

    async def connection(index: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not done.is_set():
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if not done.is_set():
                    counts[index] += 1
                    if sum(counts) >= ANSWERS:
                        done.set()
        finally:
            writer.close()

    await asyncio.wait_for(asyncio.gather(*(connection(i) for i in range(CONNECTIONS))), 300)
    return counts


def test_every_kept_alive_connection_is_answered_in_its_turn(
    model_repository, fashion_images, tmp_path
):
    # a JPEG: its size is not known before decoding, so it waits for a decode slot in its front end
    # (a PNG this small is decoded inline): the front ends' queue forms as well as the engine's
    jpeg = encode(np.stack([fashion_images[0]] * 3, axis=-1), "JPEG")
    body = json.dumps({"images": [{"b64": b64(jpeg)}]}).encode()
    # two front ends, as the service runs on two cores: connections are shared between them
    with running_server(
        model_repository, tmp_path / "service.log", suite=RELIABILITY, workers=2
    ) as server:
        counts = asyncio.run(load(server.port, body))
    typical = statistics.median(counts)
    # A fair share is ANSWERS / CONNECTIONS = 40 each. The kernel's SO_REUSEPORT hash splits the
    # connections between the two front ends unevenly (28 and 20 in one run: 35-36 answers each
    # against 46-47, as each front end answers at the same rate), which these bounds leave room for
    # up to a 37/11 split; a waiter queue served last come, first served left 9 connections at 0.
    assert min(counts) >= typical / 3, sorted(counts)
    assert max(counts) <= typical * 4, sorted(counts)
