"""Fault injection at run time: kill -9 the server or workers, or load one server with many
workers, and report what survived (docs/operations.md, "Chaos runs"). They measure and
assert nothing; tests/test_chaos.py runs a short server-kill run.
"""
