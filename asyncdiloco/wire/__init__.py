"""The wire format: the tensor manifest and payload chunks with their CRC-32, the codecs,
the hand-encoded gRPC chunk messages, the bulk channel's framing, token/TLS, and the
generated protobuf stubs. Imports nothing from ``ps``, ``worker``, ``job``, ``cli`` or ``bench``.
"""
