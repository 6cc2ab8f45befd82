"""Pulls: the snapshots pulls are served from (snapshots.py), θ read in place
(live_view.py), encoded snapshots (encoded.py) and the receive budget they share with
pushes (receive_pool.py). docs/architecture.md, "One pull".
"""
