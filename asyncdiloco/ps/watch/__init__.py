"""Watching the server: Prometheus metrics (metrics.py, grpc_metrics.py), the HTTP
endpoint (monitor.py) and its dashboard (dashboard.py). docs/operations.md.
"""
