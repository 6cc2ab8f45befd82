"""The hierarchical tier: a regional server's link to its parent (upstream.py) and the
snapshot and rebase steps on its state (rebase.py). docs/algorithms.md.
"""
