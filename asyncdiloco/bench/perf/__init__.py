"""Performance benchmarks: each script prints JSON lines; ``perf_suite`` runs them all and
writes a report (``asyncdiloco bench --suite perf``). They measure and assert nothing.
"""
