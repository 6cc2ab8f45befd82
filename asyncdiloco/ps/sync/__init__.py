"""Sync mode: rounds (rounds.py) around the quorum manager (quorum.py), the rendezvous
store (rendezvous.py) and the long poll of the quorum calls (long_poll.py).
docs/algorithms.md, "Synchronous DiLoCo".
"""
