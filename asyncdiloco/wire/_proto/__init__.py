"""Generated gRPC/protobuf stubs for ``proto/asyncdiloco/v1/parameter_server.proto``.

Never edit by hand: run ``python scripts/gen_proto.py``.
"""
