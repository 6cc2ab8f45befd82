"""Measurements: the simulator, the sync-vs-async suite (one runner for both clocks), the
demo, the peer row, the GPU check, the chaos runs (``chaos``) and the micro-benchmarks
(``perf``); each runs as ``python -m asyncdiloco.bench.<name>``. The layout:
docs/architecture.md, ``bench/``. Needs the ``bench`` extra for plots.
"""
