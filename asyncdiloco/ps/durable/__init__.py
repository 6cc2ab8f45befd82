"""Durability: the write-ahead log (wal.py, segment.py), checkpoints (checkpoints.py),
the store that drives them (store.py), the state's copies and replay (durability.py)
and a shard's folder identity (shard_files.py). docs/operations.md.
"""
