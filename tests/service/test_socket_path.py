"""The engine's socket in a deep TMPDIR: an address longer than a Unix socket's 107 bytes is reached
through a descriptor of its directory, by the engine's server and the front ends' connections alike."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from service.link import wire


def deep_directory(root: Path) -> Path:
    directory = root / ("d" * 60) / ("e" * 60)
    directory.mkdir(parents=True, mode=0o700)
    return directory


def test_a_socket_path_too_long_for_an_address_is_bound_and_reached(tmp_path):
    path = str(wire.Addresses.in_directory(str(deep_directory(tmp_path))).engine)
    assert len(os.fsencode(path)) > wire.SOCKET_PATH_MAX

    async def echo_once() -> bytes:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(5))
            await writer.drain()
            writer.close()

        with wire.socket_path(path) as address:
            server = await asyncio.start_unix_server(answer, address)
        with wire.socket_path(path) as address:
            reader, writer = await asyncio.open_unix_connection(address)
        writer.write(b"hello")
        data = await reader.readexactly(5)
        writer.close()
        server.close()
        await server.wait_closed()
        return data

    assert asyncio.run(echo_once()) == b"hello"
    assert os.path.exists(path)  # bound in the directory itself, not elsewhere


def test_a_short_socket_path_is_used_as_it_is(tmp_path):
    path = str(tmp_path / "engine")
    with wire.socket_path(path) as address:
        assert address == path
