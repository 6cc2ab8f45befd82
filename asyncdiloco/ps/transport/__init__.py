"""The transports: the gRPC servicer (grpc_service.py) and the bulk TCP channel
(bulk.py); both decode, call push/intake.py or pull/snapshots.py, and encode.
docs/architecture.md.
"""
