"""The benchmark suite (virtual-clock simulator and real-clock runner), the demo that runs
a server and workers as processes, the torchft peer, and the performance benchmarks
(``bench.perf``). Needs the ``bench`` extra for plots.
"""
