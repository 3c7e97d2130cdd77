"""Bounds on what a gRPC client can make the server hold, as grpc server options.

- messages: at most ``max_body_bytes`` (RESOURCE_EXHAUSTED beyond);
- metadata (gRPC's headers): at most ``max_header_bytes``, the HTTP listener's header bound; a call
  over it is refused by grpc before any handler runs;
- streams: at most ``MAX_CONCURRENT_STREAMS`` calls in flight on one HTTP/2 connection (nginx's
  ``http2_max_concurrent_streams`` default), where grpc's own default is unbounded.
"""

from __future__ import annotations

from service.settings import LimitSettings, ServerSettings

MAX_CONCURRENT_STREAMS = 128


def grpc_server_options(
    server: ServerSettings, limits: LimitSettings, reuse_port: bool = False
) -> list[tuple[str, int]]:
    """The options of ``grpc.aio.server`` for these bounds; ``reuse_port`` when several front ends
    share the port."""
    return [
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_metadata_size", server.max_header_bytes),
        ("grpc.absolute_max_metadata_size", server.max_header_bytes),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.so_reuseport", int(reuse_port)),
    ]
