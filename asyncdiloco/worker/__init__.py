"""Workers: the async worker (with overlap), the sync worker and its collectives, and the
clients that talk to the server. Never imports ``ps``.
"""
