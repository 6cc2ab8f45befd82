"""One virtual-clock run of the suite's (profile, method, seed), printed as a JSON line.

    python benchmarks/sim_run.py slow_link async_dn_dylu 0 wire_codec=bf16 grace_s=4

Overrides after the seed set SimConfig fields (numbers, or a string for wire_codec). The
line holds the final held-out loss, virtual wall time, utilisation, outer steps, group
sizes, true staleness, charged megabytes, transfer seconds, the rates DyLU ended with,
the CPU seconds the run took and its curve as (virtual s, loss) pairs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from asyncdiloco.bench.sim import simulate
from asyncdiloco.bench.suite import SuiteConfig, sim_config


def main(argv: list[str]) -> None:
    profile, method, seed = argv[0], argv[1], int(argv[2])
    extra = dict(a.split("=", 1) for a in argv[3:])
    cfg = sim_config(SuiteConfig(profiles=(profile,), seeds=(seed,)), profile, method, seed)
    if extra:
        cfg = dataclasses.replace(cfg, **{k: (v if k == "wire_codec" else float(v)) for k, v in extra.items()})
    started = time.process_time()
    r = simulate(cfg)
    print(
        json.dumps(
            {
                "profile": profile,
                "method": method,
                "seed": seed,
                **extra,
                "loss": round(r.final_eval_loss, 4),
                "wall_s": round(r.wall_s, 1),
                "util": round(r.utilisation, 3),
                "outer_steps": r.outer_steps,
                "groups": r.group_size_histogram,
                "true_stal": r.true_staleness_histogram[:6],
                "mean_true_stal": round(r.mean_true_staleness, 3),
                "MB": round((r.bytes_up + r.bytes_down) / 1e6, 1),
                "comm_s": round(r.comm_s, 1),
                "rates": [None if x is None else round(x, 3) for x in r.estimated_rates],
                "cpu_s": round(time.process_time() - started, 1),
                "curve": [(p["time_s"], p["eval_loss"]) for p in r.curve],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
