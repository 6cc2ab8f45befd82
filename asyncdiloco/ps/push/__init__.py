"""Push intake and apply: the one place a push is refused (intake.py), the value check
as chunks land (value_check.py), the apply of each push kind (apply.py) and a follower
shard's order (shard_order.py). docs/architecture.md, "One push".
"""
