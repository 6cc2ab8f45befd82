"""gRPC channel and server options both ends use: message limits sized to one payload chunk,
keepalive and reconnect timing."""

from __future__ import annotations

#: Room for the non-payload fields of a chunk message, in bytes.
_MESSAGE_OVERHEAD_BYTES = 64 * 1024
#: The largest HTTP/2 DATA frame each side accepts (SETTINGS_MAX_FRAME_SIZE), bytes. HTTP/2's
#: default, 16 KiB, cuts a 4 MB chunk message into 256 frames, each parsed by gRPC's
#: transport and handed to Python as a bytes object of its own; at 1 MiB a chunk is 4 frames,
#: which cut the server's CPU per 4 MB push by 7-10 % (docs/performance.md). A small call
#: multiplexed on the same connection waits behind at most one such frame.
MAX_FRAME_BYTES = 1 << 20


def grpc_channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by the server and clients: message limits just above one
    chunk, HTTP/2 frames of up to ``MAX_FRAME_BYTES``, keepalive pings that survive long
    pushes, and no SO_REUSEPORT (so a port in use is an error instead of two servers
    sharing it).

    Keepalive: each side pings after 30 s without traffic and drops the connection when
    a ping is not answered within 20 s, so a dead peer is noticed in under a minute,
    while a long push or pull (data flowing) or a long idle wait (pings answered) keeps
    its connection. The server accepts pings every 10 s even without calls, so a
    client's 30 s pings are never answered with GOAWAY "too_many_pings"."""
    limit = chunk_bytes + _MESSAGE_OVERHEAD_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_frame_size", MAX_FRAME_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # A client reconnects within seconds of a restarted server (gRPC's default backoff grows to 2 min).
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
